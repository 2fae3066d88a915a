"""Workloads and latency bookkeeping of benchmarks/engine_throughput.py, shared with its external worker
(`_external_generate.py`, run under vLLM's / transformers' Python): numpy and the standard library only.

A workload is a list of sessions `{"prompt": [ids], "arrival_s": float, "turns": [{"max_new_tokens": int,
"observation": [ids], "tool_s": float}, ...]}`: turn 0 generates after the prompt; turn k > 0 starts `tool_s`
seconds after turn k - 1 ended, with turn k - 1's observation appended to the whole context so far (the prompt,
every generated token, every observation). A and B are one-turn sessions.

`Tracker` turns a system's step loop into the rows' latencies: TTFT per turn (from the turn's release to its
first token), inter-token latency per token (a burst of n tokens of one sequence arriving at time t, its
previous token at t0, counts n gaps of (t - t0) / n; the turn's first burst counts its other n - 1 tokens
as n - 1 gaps of that step's wall time / n), and the mean decode batch (tokens / decode iterations, an
iteration being the most tokens any sequence got in a step).
"""

import time

import numpy as np


def workload(name: str, vocab: int, seed: int, quick: bool) -> list[dict]:
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(0, vocab, int(n)).tolist()

    def one_turn(prompt, new, arrival):
        return dict(prompt=ids(prompt), arrival_s=float(arrival),
                    turns=[dict(max_new_tokens=int(new), observation=[], tool_s=0.0)])

    if name == "A":  # everything at t=0: the large-batch regime
        n, new = (32, 64) if quick else (64, 128)
        return [one_turn(128, new, 0.0) for _ in range(n)]
    if name == "B":  # heavy-tailed lengths, Poisson arrivals
        n = 24 if quick else 64
        prompts = np.clip(rng.lognormal(np.log(160), 0.9, n), 16, 1024).astype(int)
        outputs = np.clip(16 * (rng.pareto(1.3, n) + 1), 16, 512).astype(int)
        arrivals = np.cumsum(rng.exponential(0.05, n))
        return [one_turn(p, o, a) for p, o, a in zip(prompts, outputs, arrivals)]
    if name == "C":  # agentic: 2-4 turns, tool observations appended, sessions staggered (small batches)
        n = 8 if quick else 24
        out = []
        for i in range(n):
            turns = [dict(max_new_tokens=int(rng.integers(32, 97)), observation=ids(rng.integers(20, 81)),
                          tool_s=float(rng.uniform(0.05, 0.3))) for _ in range(int(rng.integers(2, 5)))]
            turns[-1]["observation"] = []
            out.append(dict(prompt=ids(rng.integers(100, 301)), arrival_s=float(i * 0.5 + rng.uniform(0, 0.2)),
                            turns=turns))
        return out
    raise ValueError(f"unknown workload {name!r} (A, B, C)")


def describe(sessions: list[dict]) -> str:
    turns = sum(len(s["turns"]) for s in sessions)
    prompt = sum(len(s["prompt"]) + sum(len(t["observation"]) for t in s["turns"]) for s in sessions)
    out = sum(t["max_new_tokens"] for s in sessions for t in s["turns"])
    return f"{len(sessions)} sessions, {turns} turns, {prompt} prompt/observation tokens, {out} output tokens"


def output_tokens(sessions: list[dict]) -> int:
    return sum(t["max_new_tokens"] for s in sessions for t in s["turns"])


class Tracker:
    """TTFT, inter-token gaps and decode iterations of one timed run (times in seconds from its start)."""

    def __init__(self):
        self.ttft, self.itl = [], []
        self.tokens = self.iterations = 0
        self._start, self._count, self._last = {}, {}, {}

    def turn_started(self, key, t: float) -> None:
        self._start[key], self._count[key], self._last[key] = t, 0, None

    def step(self, t0: float, t1: float, counts: dict) -> None:
        """One step of a continuous-batching loop from t0 to t1; `counts`: key -> tokens its turn has now."""
        most = 0
        for key, n in counts.items():
            d = n - self._count[key]
            if d <= 0:
                continue
            self._count[key] = n
            self.tokens += d
            most = max(most, d)
            if self._last[key] is None:
                self.ttft.append(t1 - self._start[key])
                self.itl += [(t1 - t0) / d] * (d - 1)
            else:
                self.itl += [(t1 - self._last[key]) / d] * d
            self._last[key] = t1
        self.iterations += most

    def static_batch(self, released: list[float], done: float, seconds: float, useful: int, steps: int) -> None:
        """A static batch (prefill + `steps` decode steps in `seconds`, returned at `done`): every request's
        first token comes when the batch returns; each token's gap is the batch's time per step."""
        self.ttft += [done - r for r in released]
        self.itl += [seconds / max(1, steps)] * useful
        self.tokens += useful
        self.iterations += steps

    def summary(self) -> dict:
        def pct(v, q):
            return float(np.percentile(v, q)) if v else None
        return dict(ttft_p50_s=pct(self.ttft, 50), ttft_p95_s=pct(self.ttft, 95), itl_p50_s=pct(self.itl, 50),
                    itl_p95_s=pct(self.itl, 95),
                    mean_batch=self.tokens / self.iterations if self.iterations else None)


def static_batches(sessions: list[dict], generate, batch: int = 16):
    """One-turn sessions as static batches: all at once when every request is there at t=0, else `batch`
    requests at a time in arrival order, each batch started when its last request has arrived.
    `generate(prompts, max_new_tokens, index)` runs one batch. Returns (useful tokens, seconds, Tracker)."""
    order = sorted(range(len(sessions)), key=lambda i: sessions[i]["arrival_s"])
    size = len(sessions) if all(s["arrival_s"] == 0 for s in sessions) else batch
    tracker, tokens = Tracker(), 0
    start = time.perf_counter()
    for b in range(0, len(order), size):
        idx = order[b:b + size]
        wait = max(sessions[i]["arrival_s"] for i in idx) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        n = max(sessions[i]["turns"][0]["max_new_tokens"] for i in idx)
        b0 = time.perf_counter()
        generate([sessions[i]["prompt"] for i in idx], n, b)
        done = time.perf_counter()
        useful = sum(sessions[i]["turns"][0]["max_new_tokens"] for i in idx)  # padding's tokens not counted
        tracker.static_batch([sessions[i]["arrival_s"] for i in idx], done - start, done - b0, useful, n)
        tokens += useful
    return tokens, time.perf_counter() - start, tracker
