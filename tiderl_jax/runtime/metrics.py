"""Run metrics (docs/glossary.md, docs/outputs.md): goodput, per-step time, waiting per device group, KV hit rate,
staleness, reward; written as TensorBoard event files and JSONL, a log line per step with rates, and
at the end a summary table and a timeline PNG of what each device group did.

Definitions (one each):
- goodput: tokens (and samples) of trajectories consumed by optimizer updates per wall second;
  discarded (over-stale, failed, dropped) work does not count;
- per-step time: wall time between consecutive optimizer updates;
- waiting time: device-seconds a lane's devices were idle, split into rollout waiting (the rollout
  lane had nothing to generate) and trainer waiting (the train lane waited for data or for a sync);
  a lane's busy time comes from the spans the controller records (`span`), its waiting time is
  wall time minus busy time, times its device count. Lanes that take turns on the same devices
  (`shared`, the sync mode) count each device once: it waits when no lane's span covers it, and
  that idle time is rollout waiting while the trainer waits for data (`data_wait`), else trainer
  waiting; devices idle inside a shared lane's span (a backend that knows, e.g. the simulator's
  replicas that finished their share of a synchronous batch, reports them in `idle_in_spans`)
  count as that lane's waiting too;
- KV hit rate: prompt tokens served from cache / all prompt tokens prefilled (the engine's counter);
- staleness: per consumed token, current policy version minus the version that generated it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import time

log = logging.getLogger(__name__)

LANES = ("rollout", "ref", "train")
_COLORS = {"generate": "tab:blue", "score": "tab:orange", "train": "tab:green", "sync": "tab:red",
           "move": "tab:purple", "sft": "tab:olive", "eval": "tab:gray"}


class RunMetrics:
    def __init__(self, logdir: str, *, total_steps: int, devices: dict[str, int] | None = None,
                 shared: tuple[str, ...] = (), clock=time.perf_counter):
        from tensorboardX import SummaryWriter  # imported here: only runs that log need it

        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self.total_steps = total_steps
        self.devices = dict(devices or {})  # lane -> devices it holds (changes on ERS moves)
        self.writer = SummaryWriter(logdir)
        self.jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")
        self.clock = clock  # seconds; the simulator's is virtual
        self.t0 = clock()
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, kind, start, end) since t0
        self.shared = tuple(shared)  # lanes holding the same devices (they take turns)
        if self.shared and len({self.devices.get(lane) for lane in self.shared}) != 1:
            raise ValueError(f"shared lanes {self.shared} must hold the same device count; got {self.devices}")
        self.data_waits: list[tuple[float, float]] = []  # when the trainer waited for data
        self.busy_device_s = collections.Counter()  # lane -> device-seconds busy
        self.busy_s = collections.Counter()  # lane -> wall seconds busy
        self.device_s = collections.Counter()  # lane -> device-seconds held (busy or idle)
        self.idle_in_spans = collections.Counter()  # shared lane -> device-seconds idle inside its spans
        self._held_since = {lane: 0.0 for lane in self.devices}
        self.consumed_tokens = 0
        self.consumed_samples = 0
        self.staleness = collections.Counter()  # version lag -> tokens
        self.step_times: list[float] = []
        self.rewards: list[float] = []
        self.last_step_end = None
        self.steps = 0

    def begin(self) -> None:
        """Starts the clock of the run proper (what came before, e.g. a warm start, is not in it)."""
        self.t0 = self.clock()
        self.spans.clear()
        self.data_waits.clear()
        self.busy_device_s.clear()
        self.busy_s.clear()
        self.device_s.clear()
        self.idle_in_spans.clear()
        self._held_since = {lane: 0.0 for lane in self.devices}

    def now(self) -> float:
        return self.clock() - self.t0

    @contextlib.contextmanager
    def span(self, lane: str, kind: str):
        """Marks `lane` busy with `kind` for the duration of the block."""
        start = self.now()
        try:
            yield
        finally:
            end = self.now()
            self.spans.append((lane, kind, start, end))
            self.busy_device_s[lane] += (end - start) * self.devices.get(lane, 0)
            self.busy_s[lane] += end - start

    @contextlib.contextmanager
    def data_wait(self):
        """Marks the trainer waiting for data for the duration of the block."""
        start = self.now()
        try:
            yield
        finally:
            self.data_waits.append((start, self.now()))

    def set_devices(self, lane: str, count: int) -> None:
        """A lane's device count changed (an ERS move): close its held-time interval."""
        now = self.now()
        self.device_s[lane] += (now - self._held_since.get(lane, now)) * self.devices.get(lane, 0)
        self._held_since[lane] = now
        self.devices[lane] = count

    def consume(self, tokens: int, samples: int, lags: dict[int, int], reward: float) -> None:
        """An optimizer update consumed `samples` trajectories with `tokens` trained tokens."""
        self.consumed_tokens += tokens
        self.consumed_samples += samples
        self.staleness.update(lags)
        self.rewards.append(reward)

    def log_step(self, step: int, values: dict) -> None:
        now = self.now()
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
        self.last_step_end = now
        self.steps = step
        wait = self.waiting()
        values = dict(values, goodput_tokens_per_s=self.consumed_tokens / max(now, 1e-9),
                      goodput_samples_per_s=self.consumed_samples / max(now, 1e-9), wall_s=now,
                      consumed_tokens=self.consumed_tokens, consumed_samples=self.consumed_samples,
                      rollout_wait_total_s=wait.get("rollout", 0.0),
                      trainer_wait_total_s=wait.get("train", 0.0) + wait.get("ref", 0.0))
        for k, v in values.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        from tiderl_jax.progress import format_seconds
        recent = self.step_times[-5:] or [now]
        eta = (self.total_steps - step) * sum(recent) / len(recent)
        log.info("RL step %d/%d  %.1fs  reward %.3f  goodput %.0f tok/s  loss %.4f  step time %.1fs  ETA %s",
                 step, self.total_steps, now, values.get("reward", float("nan")), values["goodput_tokens_per_s"],
                 values.get("loss", float("nan")), self.step_times[-1] if self.step_times else now,
                 format_seconds(eta))

    def waiting(self) -> dict[str, float]:
        """Device-seconds each lane was idle so far."""
        now = self.now()
        held = {lane: self.device_s[lane] + (now - self._held_since.get(lane, now)) * n
                for lane, n in self.devices.items()}
        wait = {lane: max(0.0, held[lane] - self.busy_device_s[lane]) for lane in held
                if lane not in self.shared}
        if self.shared:
            idle = _complement(_union(s[2:] for s in self.spans if s[0] in self.shared), now)
            in_rollout = _overlap(idle, _union(self.data_waits))
            n = self.devices[self.shared[0]]
            total = sum(b - a for a, b in idle)
            wait["rollout"] = wait.get("rollout", 0.0) + n * in_rollout
            wait["train"] = wait.get("train", 0.0) + n * (total - in_rollout)
            for lane in self.shared:
                wait[lane] = wait.get(lane, 0.0) + self.idle_in_spans[lane]
        return wait

    def summary(self) -> dict:
        wall = self.now()
        wait = self.waiting()
        return dict(
            steps=self.steps, wall_s=wall,
            goodput_tokens_per_s=self.consumed_tokens / max(wall, 1e-9),
            goodput_samples_per_s=self.consumed_samples / max(wall, 1e-9),
            step_time_s=sum(self.step_times) / len(self.step_times) if self.step_times else wall,
            rollout_wait_s=wait.get("rollout", 0.0),
            trainer_wait_s=wait.get("train", 0.0) + wait.get("ref", 0.0),
            staleness={int(k): int(v) for k, v in sorted(self.staleness.items())},
            mean_reward=sum(self.rewards) / len(self.rewards) if self.rewards else 0.0)

    def plot_timeline(self, path: str) -> str:
        """A PNG of what each lane did over time (one row per lane, a bar per span)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lanes = [lane for lane in LANES if any(s[0] == lane for s in self.spans)]
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * max(1, len(lanes))))
        for row, lane in enumerate(lanes):
            for ln, kind, start, end in self.spans:
                if ln == lane:
                    ax.broken_barh([(start, max(end - start, 1e-3))], (row - 0.4, 0.8),
                                   color=_COLORS.get(kind, "black"))
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlabel("seconds")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in _COLORS.items()
                   if any(s[1] == k for s in self.spans)]
        ax.legend(handles, [k for k in _COLORS if any(s[1] == k for s in self.spans)],
                  loc="upper center", ncol=8, bbox_to_anchor=(0.5, 1.35), frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def _union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _complement(disjoint: list[tuple[float, float]], end: float) -> list[tuple[float, float]]:
    """The parts of [0, end] that sorted, disjoint intervals leave uncovered."""
    out, t = [], 0.0
    for a, b in disjoint:
        if a > t:
            out.append((t, min(a, end)))
        t = max(t, b)
    if t < end:
        out.append((t, end))
    return [(a, b) for a, b in out if b > a]


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Seconds covered by both of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
