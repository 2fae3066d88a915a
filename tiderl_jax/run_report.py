"""The main job's summary: the printed table and `summary.json`, from numbers alone (JAX-free); the
invocation's phases (`Phases`: seconds per phase, and their spans for the timeline).

- Held-out results as counts beside rates (`3/16 (0.188) -> 5/16 (0.312)`): a task counts as solved
  when its reward is 1 (the `python` task's partial rewards are in the mean reward, shown beside).
- Two clocks, named: `rl_wall_s` (the RL phase of this invocation, the controller's clock) and
  `total_wall_s` (every phase of this invocation: start, warm start, evaluations, RL, summary).
- The sample ledger, whole run (`ledger_accounts`): every admitted sample ends once, as completed or
  dropped with its reason, or is still unfinished when RL stops; completed samples were trained, dropped
  as stale, are still waiting (ready, the update being assembled included, or in a group not yet
  complete), or were lost when RL was interrupted (the checkpoint keeps the update being assembled and
  the groups not yet admitted again, so normally none). Anything that does not add up is shown as
  `unexplained`, not hidden.
- ERS: its moves with their reasons; how many step boundaries it refused a move it wanted (the
  controller counts refusals and keeps only the last boundary's reason; each is in the log as
  `ERS: no move (...)`).
"""

from __future__ import annotations

import time


class Phases:
    """The phases of one invocation of the main job: wall seconds per phase name (summary.json's `phases_s`)
    and each phase's span `(name, start, end)` in `clock` seconds, in order (a name entered twice has two)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.current = "start"
        self._t = clock()

    def enter(self, name: str) -> None:
        now = self.clock()
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._t
        self.spans.append((self.current, self._t, now))
        self.current, self._t = name, now

    def spans_on(self, clock) -> list[tuple[str, float, float]]:
        """`spans` in another clock's seconds (`RunMetrics.plot_timeline`'s `phases` are in the run metrics'
        `clock`): shifted by the two clocks' difference, read now."""
        offset = clock() - self.clock()
        return [(name, start + offset, end + offset) for name, start, end in self.spans]


def solved(rewards) -> tuple[int, int]:
    """(tasks solved, tasks): solved means reward >= 1."""
    return sum(r >= 1 for r in rewards), len(rewards)


def count_rate(rewards) -> str:
    k, n = solved(rewards)
    return f"{k}/{n} ({k / n:.3f})" if n else "0/0"


def heldout_numbers(results: dict) -> dict:
    """{"solved", "tasks", "rate", "mean_reward"} of one held-out result (`rl.evaluate.heldout_results`)."""
    k, n = solved(results["rewards"])
    return dict(solved=k, tasks=n, rate=k / n if n else 0.0,
                mean_reward=sum(results["rewards"]) / n if n else 0.0)


def by_kind(results: dict) -> dict:
    """`heldout_numbers` per task kind."""
    kinds: dict[str, list[float]] = {}
    for kind, reward in zip(results["kinds"], results["rewards"]):
        kinds.setdefault(kind, []).append(reward)
    return {k: heldout_numbers({"rewards": v}) for k, v in kinds.items()}


def ledger_accounts(ledger: dict, *, unfinished: int, trained: int, ready: int, waiting: int,
                    interrupted: int = 0) -> dict:
    """The ledger's identity, each term named. `ledger`: the controller's counters (`admitted`,
    `completed`, `dropped:<reason>`; `dropped:stale` samples were completed first); `unfinished`:
    admitted samples that had not ended when RL stopped; `trained`: samples the trainer consumed;
    `ready`: completed samples in the ready buffer at the end (with the update being assembled);
    `waiting`: completed samples of groups whose other samples had not ended; `interrupted`: completed
    samples an interruption (Ctrl-C, a failure) of RL lost: those the ledger could not place then, which
    the checkpoint does not keep, so they are neither trained nor generated again (counted by
    `launch/train.py` when it happens; the checkpoint keeps the update being assembled and the groups not
    yet admitted again, so normally none)."""
    admitted, completed = ledger.get("admitted", 0), ledger.get("completed", 0)
    dropped = {k.split(":", 1)[1]: v for k, v in sorted(ledger.items()) if k.startswith("dropped:") and v}
    stale = dropped.pop("stale", 0)
    uninformative = dropped.pop("zero_variance", 0)  # completed first, like the stale ones
    return dict(
        admitted=admitted, completed=completed, dropped=dropped, unfinished=unfinished,
        unexplained=admitted - completed - sum(dropped.values()) - unfinished,
        completed_as=dict(trained=trained, dropped_stale=stale, dropped_zero_variance=uninformative, ready_at_end=ready,
                          in_unfinished_groups=waiting, lost_at_interruptions=interrupted,
                          unexplained=completed - trained - stale - uninformative - ready - waiting - interrupted))


def ledger_lines(acc: dict) -> list[str]:
    """The identity in two lines: admitted = completed + dropped (by reason) + unfinished, and what the
    completed samples became."""
    dropped = sum(acc["dropped"].values())
    reasons = ", ".join(f"{k} {v}" for k, v in acc["dropped"].items())
    first = (f"admitted {acc['admitted']} = completed {acc['completed']} + dropped {dropped}"
             + (f" ({reasons})" if reasons else "") + f" + unfinished when RL stopped {acc['unfinished']}"
             + (f" + unexplained {acc['unexplained']}" if acc["unexplained"] else ""))
    c = acc["completed_as"]
    second = (f"completed {acc['completed']} = trained {c['trained']} + dropped as stale {c['dropped_stale']} + "
              + (f"dropped with all rewards equal {c['dropped_zero_variance']} + "
                 if c.get("dropped_zero_variance") else "")
              + f"ready at the end {c['ready_at_end']} + in groups not yet complete {c['in_unfinished_groups']}"
              + (f" + lost when RL was interrupted {c['lost_at_interruptions']}"
                 if c["lost_at_interruptions"] else "")
              + (f" + unexplained {c['unexplained']}" if c["unexplained"] else ""))
    return [first, second]


def ers_line(moves: list[dict], refused: int, last_refusal: str, refusals: dict | None = None) -> str:
    """ERS's and RA2P's moves with their reasons, and ERS's refusals by kind (`ers.REFUSALS`)."""
    shown = "; ".join(f"step {m['step']} {m['by']} {m['frm']} -> {m['to']} ({m['reason']})" for m in moves)
    out = f"{len(moves)} moves" + (f": {shown}" if shown else "")
    out += f"; {refused} step boundaries where ERS wanted a move and refused it"
    if refused:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted((refusals or {}).items(), key=lambda kv: -kv[1]))
        out += (f" ({kinds})" if kinds else "") + \
            (f"; the last: {last_refusal}" if last_refusal else "") + " (each is in the log: 'ERS: no move (...)')"
    return out


def summary_rows(*, mode: str, rl: dict, batch_samples: int, before: dict, after: dict, gains: dict,
                 phases_s: dict, total_s: float, compiles: tuple[int, float], files: dict) -> list[tuple[str, str]]:
    """The printed table: (row name, text) pairs. `rl`: the RL record (the controller's summary with
    `rewards`, `step`, `ledger_accounts`, `ers_moves`, `ers_refusal_last`); `before` / `after`:
    {"greedy"[, "sampled"]: heldout_results}; `gains`: {name: (mean, low, high)}; `files`: {row: text}."""
    rewards = rl.get("rewards") or [float("nan")]
    k = max(1, len(rewards) // 4)
    rows = [("mode", mode),
            ("updates", f"{len(rl.get('rewards') or [])} x {batch_samples} samples in this invocation; the run is "
                        f"at step {rl.get('step', rl['steps'])}"),
            ("train reward", f"first quarter of the updates {sum(rewards[:k]) / k:.3f}, last quarter "
                             f"{sum(rewards[-k:]) / k:.3f} (every sample drawn, dynamic sampling's dropped groups "
                             "included)")]
    for name in before:
        d, lo, hi = gains[name]
        b, a = before[name], after[name]
        nb, na = heldout_numbers(b), heldout_numbers(a)
        rows += [(f"held-out {name}", f"{count_rate(b['rewards'])} -> {count_rate(a['rewards'])} tasks solved; "
                                      f"mean reward {nb['mean_reward']:.3f} -> {na['mean_reward']:.3f}, gain "
                                      f"{d:+.3f} [95% CI {lo:+.3f}, {hi:+.3f}]"),
                 ("  by kind", "  ".join(f"{kind} {x['solved']}/{x['tasks']} -> {by_kind(a)[kind]['solved']}/"
                                         f"{by_kind(a)[kind]['tasks']}" for kind, x in by_kind(b).items()))]
    ledger = ledger_lines(rl["ledger_accounts"])
    rows += [("goodput", f"{rl['goodput_tokens_per_s']:.0f} tokens/s, {rl['goodput_samples_per_s']:.2f} samples/s"),
             ("step time", f"{rl['step_time_s']:.2f}s"),
             ("waiting (device-s)", f"rollout {rl['rollout_wait_s']:.0f}, trainer {rl['trainer_wait_s']:.0f}"),
             ("KV hit rate", f"{rl['kv_hit_rate']:.3f}"),
             *([("mixture", mixture_line(rl["mixture"]))] if rl.get("mixture") else []),
             ("samples (whole run)", ledger[0]), ("", ledger[1]),
             ("moves", ers_line(rl.get("ers_moves", []), rl.get("ers_refused", 0), rl.get("ers_refusal_last", ""),
                                rl.get("ers_refusals"))),
             ("compiles", f"{compiles[0]} device programs, {compiles[1]:.0f}s (inside the times below)"),
             ("RL wall time", f"{rl['wall_s']:.0f}s (rl_wall_s: the RL phase of this invocation)"),
             ("total wall time", f"{total_s:.0f}s (total_wall_s: every phase of this invocation: "
                                 + ", ".join(f"{k} {v:.0f}s" for k, v in phases_s.items() if v >= 0.5) + ")")]
    return rows + list(files.items())


def mixture_line(m: dict) -> str:
    """The workload mixture row: target and trained shares per class, and the deviation."""
    total = max(1, sum(m["trained"].values()))
    shares = ", ".join(f"{cls} {share:.3f} -> {m['trained'].get(cls, 0) / total:.3f}" for cls, share in m["target"].items())
    return f"target -> trained share: {shares}; deviation {m['deviation']:.3f} (0.5 * sum |target - trained|)"


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def summary_json(*, rl: dict, before: dict, after: dict, gains: dict, phases_s: dict, total_s: float,
                 compiles: tuple[int, float], devices: int, platform: str, files: dict) -> dict:
    """summary.json (docs/outputs.md lists every key)."""
    out = {k: v for k, v in rl.items() if k not in ("wall_s", "ledger_accounts")}
    d, lo, hi = gains["greedy"]
    n = len(before["greedy"]["rewards"])
    out.update(
        rl_wall_s=rl["wall_s"], total_wall_s=total_s, phases_s=phases_s, ledger=rl["ledger_accounts"],
        ledger_counters=rl["ledger"], heldout_tasks=n,
        heldout_before={k: heldout_numbers(v) for k, v in before.items()},
        heldout_after={k: heldout_numbers(v) for k, v in after.items()},
        heldout_success_before={k: heldout_numbers(v)["rate"] for k, v in before.items()},
        heldout_success_after={k: heldout_numbers(v)["rate"] for k, v in after.items()},
        heldout_by_kind_before={k: by_kind(v) for k, v in before.items()},
        heldout_by_kind_after={k: by_kind(v) for k, v in after.items()},
        heldout_gain=d, heldout_gain_ci95=[lo, hi], compiled_programs=compiles[0],
        compile_s=compiles[1], devices=devices, platform=platform, files=files)
    if "sampled" in gains:  # eval.sampled
        out.update(heldout_gain_sampled=gains["sampled"][0], heldout_gain_sampled_ci95=list(gains["sampled"][1:]))
    return out
