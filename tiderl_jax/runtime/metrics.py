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

metrics.jsonl keeps one flat record per update (the names benchmarks, tests and plots read); TensorBoard
groups the same scalars by prefix (`tensorboard_tag`): `train/` (the optimizer step and the batch's reward),
`rollout/` (what the samples looked like), `sched/` (time, waiting, goodput and the mechanisms' signals),
`eval/` (evaluations during RL, `eval_<name>` in the record) and `sft/` (the warm start, `log_scalars`).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import logging
import math
import os
import time
from typing import Sequence

log = logging.getLogger(__name__)

LANES = ("rollout", "ref", "train")
_COLORS = {"generate": "tab:blue", "score": "tab:orange", "train": "tab:green", "sync": "tab:red",
           "move": "tab:purple", "sft": "tab:olive", "eval": "tab:gray"}
# TensorBoard groups of the per-update keys (metrics.jsonl keeps them flat); `eval_*` and `sft_*` go to eval/, sft/
TAG_GROUPS = {
    "train": ("reward", "reward_std", "sampled_reward", "zero_variance_groups", "zero_variance_dropped", "loss",
              "policy_loss", "kl", "entropy", "value_loss", "nll", "grad_norm", "skipped", "lr", "clip_fraction",
              "dual_clip_fraction", "approx_kl", "ratio", "importance_weight", "truncated_fraction", "tokens", "sequences", "dropped",
              "shared_groups", "version", "proximal_recomputed", "proximal_in_step", "on_policy", "behaviour_logp_diff_mean",
              "behaviour_logp_diff_p99", "tokens_computed", "tokens_real", "attention_pairs",
              "attention_pairs_computed", "row_len"),
    "rollout": ("response_tokens_mean", "response_tokens_max", "turns_mean", "tool_calls_mean", "tool_error_rate",
                "malformed_turn_rate", "kv_hit_rate", "staleness_mean", "running", "ready_groups", "discarded",
                "consumed_tokens", "consumed_samples"),
    "sched": ("goodput_tokens_per_s", "goodput_samples_per_s", "wall_s", "step_time_s", "trainer_wait_s",
              "rollout_wait_total_s", "trainer_wait_total_s", "ras", "hol_s", "time_proximal_s", "time_ref_s",
              "time_update_s", "compile_total_s", "rollout_devices", "ra2p_decoupled", "ra2p_cost_colocated",
              "ra2p_cost_decoupled", "ers_train_coupling", "ers_scaling", "ers_rollout_scaling", "sync_s",
              "sync_bytes", "exchange_total_s"),
}
_GROUP_OF = {key: group for group, keys in TAG_GROUPS.items() for key in keys}


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: `train/loss`, `rollout/turns_mean`, `sched/ras`, `eval/success`
    (from `eval_success`), `sft/nll`; a key of no group goes to `other/`."""
    for prefix in ("eval", "sft"):
        if key.startswith(prefix + "_"):
            return f"{prefix}/{key[len(prefix) + 1:]}"
    return f"{_GROUP_OF.get(key, 'other')}/{key}"


class RunMetrics:
    def __init__(self, logdir: str, *, total_steps: int, devices: dict[str, int] | None = None,
                 shared: tuple[str, ...] = (), clock=time.perf_counter, write: bool = True):
        """`write=False` (a multi-process run's processes but the first): everything is counted, nothing written."""
        from tensorboardX import SummaryWriter  # imported here: only runs that log need it

        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self.total_steps = total_steps
        self.devices = dict(devices or {})  # lane -> devices it holds (changes on ERS moves)
        self.writer = SummaryWriter(logdir) if write else _NoWriter()
        self.jsonl = open(os.path.join(logdir, "metrics.jsonl") if write else os.devnull, "a")
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
        self.phases: list[tuple[str, float, float]] = []  # (name, start, end) in `clock` seconds, e.g. evaluations
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
        self.phases.clear()
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
                      step_time_s=self.step_times[-1] if self.step_times else now,
                      consumed_tokens=self.consumed_tokens, consumed_samples=self.consumed_samples,
                      rollout_wait_total_s=wait.get("rollout", 0.0),
                      trainer_wait_total_s=wait.get("train", 0.0) + wait.get("ref", 0.0))
        self._scalars(step, values)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        from tiderl_jax.progress import format_seconds
        recent = self.step_times[-5:] or [now]
        eta = (self.total_steps - step) * sum(recent) / len(recent)
        dropped = "zero_variance_dropped" in values  # dynamic sampling: the all-equal groups were not trained on
        log.info("RL step %d/%d  %.1fs  reward %.3f ± %.3f (%.0f%% of groups all-equal%s)  goodput %.0f tok/s  loss %.4f"
                 "  step time %.1fs  ETA %s", step, self.total_steps, now, values.get("reward", math.nan),
                 values.get("reward_std", math.nan),
                 100 * values.get("zero_variance_dropped" if dropped else "zero_variance_groups", math.nan),
                 ", dropped" if dropped else "", values["goodput_tokens_per_s"], values.get("loss", math.nan),
                 values["step_time_s"], format_seconds(eta))

    def _scalars(self, step: int, values: dict, prefix: str = "") -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(tensorboard_tag(prefix + k), v, step)

    def log_scalars(self, group: str, step: int, values: dict) -> None:
        """TensorBoard scalars of another phase at its own step (not in metrics.jsonl, one record per update):
        `log_scalars("sft", 100, {"nll": 0.4})` is `sft/nll` at step 100."""
        self._scalars(step, values, prefix=group + "_")
        self.writer.flush()

    async def run_hook(self, hook, step: int) -> dict:
        """`hook(step)` after an update (a function or a coroutine function; `Controller.run(on_step=...)`): the
        scalars it returns, named `eval_<name>` for the update's record (TensorBoard `eval/<name>`). The time it
        took, when it returned scalars, is an `eval` phase on the timeline."""
        if hook is None:
            return {}
        start = self.clock()
        out = hook(step)
        if inspect.isawaitable(out):
            out = await out
        if not out:
            return {}
        self.phases.append(("eval", start, self.clock()))
        return {f"eval_{k}": v for k, v in out.items()}

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

    def plot_timeline(self, path: str, *, mode: str | None = None, title: str | None = None,
                      phases: Sequence[tuple[str, float, float]] = ()) -> str:
        """A PNG of what each lane did over time (one row per lane, a bar per span), titled with `mode` (and
        `title`). `phases`: (name, start, end) in `clock` seconds (`time.perf_counter()` for the real backend),
        e.g. the invocation's warm start, held-out evaluations and RL; they are drawn in a `phases` row above the
        lanes with the evaluations during RL (`phases` of this object), and the x axis then starts at the first
        phase (seconds since the invocation began) instead of at the RL phase's start."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        marks = list(phases) + self.phases
        origin = min([self.t0] + [a for _, a, _ in marks])  # seconds on the axis count from here
        shift = self.t0 - origin  # spans are stored since t0
        lanes = [lane for lane in LANES if any(s[0] == lane for s in self.spans)]
        rows = lanes + (["phases"] if marks else [])
        fig, ax = plt.subplots(figsize=(12, 1.3 + 0.6 * max(1, len(rows))))
        row_of = {lane: row for row, lane in enumerate(lanes)}
        bars = collections.defaultdict(list)  # (row, kind) -> its spans: one collection each (one per span took
        for lane, kind, start, end in self.spans:  # a sync run's thousands of spans 100 s to draw)
            if lane in row_of:
                bars[row_of[lane], kind].append((shift + start, max(end - start, 1e-3)))
        for (row, kind), ranges in bars.items():
            ax.broken_barh(ranges, (row - 0.4, 0.8), color=_COLORS.get(kind, "black"))
        colors = plt.get_cmap("Pastel1")
        width = max([e - origin for _, _, e in marks] + [shift + e for *_, e in self.spans] + [1e-9])
        narrow = []  # phases too short to hold their name: named in the legend instead
        for i, (name, start, end) in enumerate(phases):  # the invocation's phases: labelled, the upper part
            ax.broken_barh([(start - origin, max(end - start, 1e-3))], (len(lanes) - 0.1, 0.5),
                           color=colors(i % 9), edgecolor="gray")
            if end - start >= 0.08 * width:
                ax.text(start - origin + (end - start) / 2, len(lanes) + 0.15, name, ha="center", va="center",
                        fontsize=7, clip_on=True)
            else:
                narrow.append((name, colors(i % 9)))
        for _, start, end in self.phases:  # evaluations during RL: the lower part, in the legend
            ax.broken_barh([(start - origin, max(end - start, 1e-3))], (len(lanes) - 0.4, 0.3),
                           color=_COLORS["eval"])
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel("seconds since the invocation began" if phases else "seconds since the RL phase began")
        kinds = [k for k in _COLORS if any(s[1] == k for s in self.spans) or (k == "eval" and self.phases)]
        ax.legend([plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in kinds]
                  + [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="gray") for _, c in narrow],
                  [k if k != "eval" else "evaluation during RL" for k in kinds] + [f"phase: {n}" for n, _ in narrow],
                  loc="lower center", ncol=8, bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize=8)
        heading = " - ".join(x for x in (f"{mode} mode" if mode else "", title or "") if x)
        if heading:
            fig.suptitle(heading)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


class _NoWriter:
    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


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
