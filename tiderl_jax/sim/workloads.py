"""Workload presets after the papers, and the distributions the simulator samples tasks from.

A `Workload` says what one RL run looks like: model, accelerator, cluster size, batch (prompts x
GRPO group size), and per task: prompt tokens, number of turns, tokens the model generates per
turn, tokens each observation adds, and the environment's latency per tool call. `sample_task`
draws one task's trajectory shape; the simulated rollout replays it turn by turn.

**What is the paper's and what is ours.** Every preset lists each of its parameters in exactly one
of `from_paper` (stated by the paper's settings as our record holds them, summarised in
docs/mechanisms.md, "The papers' settings and headline numbers") or `assumed` (ours: a plausible
value the record does not give, chosen before any simulation and never adjusted to reach a published
number). `check_workload` enforces the partition. When a paper's full setting becomes available,
replace the assumption and move the field to `from_paper`.

**Workload classes** (MISA-T's): every task carries a class, `rlvr` (single turn, long outputs: verifiable
rewards), `rlhf` (single turn, medium outputs: a reward model) or `agentic` (multi-turn, long contexts, tool
gaps), its workload's `task_class`. A **mixed** workload (`mixed`, `Workload.parts`) draws each GRPO group (one
prompt: one class) from one of its parts, chosen with the part's share; `MISA_T_MIX` is the MISA-T paper's
trace (Qwen3.6-35B-A3B on 4 x TP4 H100) at its trainer's target mixture, agentic / RLVR / RLHF = 48.6 / 33.1 /
18.2 %.

Distributions (all ours in form): lognormal for environment latency (heavy right tail: most tool
calls are quick, a few are slow), for tokens per turn and for turns, clipped to their ranges;
`Fixed` for a constant.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np

from tiderl_jax.policies.misa_t import CLASSES, PAPER_TARGET


@dataclasses.dataclass(frozen=True)
class Fixed:
    value: float

    def __post_init__(self):
        if not self.value >= 0:
            raise ValueError(f"Fixed.value={self.value} must be >= 0")

    def mean(self) -> float:
        return float(self.value)

    def sample(self, rng: np.random.Generator, size: int | None = None):
        return self.value if size is None else np.full(size, self.value)


@dataclasses.dataclass(frozen=True)
class ClippedLognormal:
    """`exp(N(log(median), sigma^2))` clipped to [low, high], rounded to integers if `integer`."""
    median: float
    sigma: float
    low: float = 0.0
    high: float = math.inf
    integer: bool = False

    def __post_init__(self):
        if not self.median > 0:
            raise ValueError(f"ClippedLognormal.median={self.median} must be > 0")
        if not self.sigma >= 0:
            raise ValueError(f"ClippedLognormal.sigma={self.sigma} must be >= 0")
        if not 0 <= self.low <= self.median <= self.high:
            raise ValueError(f"ClippedLognormal: need 0 <= low={self.low} <= median={self.median} <= high={self.high}")

    def mean(self) -> float:
        """Mean before clipping: `median * exp(sigma^2 / 2)`."""
        return self.median * math.exp(self.sigma ** 2 / 2)

    def sample(self, rng: np.random.Generator, size: int | None = None):
        x = np.minimum(np.maximum(rng.lognormal(math.log(self.median), self.sigma, size), self.low), self.high)
        if self.integer:
            x = np.rint(x).astype(np.int64)
        return x.item() if size is None else x


Distribution = Fixed | ClippedLognormal


@dataclasses.dataclass(frozen=True)
class Drift:
    """How a workload's tasks change over a run (ours in every part): in agentic RL the policy's response
    lengths and turn counts move as it learns, and each step's batch differs from the last, so the
    bottleneck moves between rollout and training. At training progress p in [0, 1] (the step a group
    is admitted at / the run's steps) the medians of `tokens_per_turn` and `turns` are multiplied by
    piecewise-linear schedules through the knots `(p, factor)`, then by a per-step factor
    `exp(N(0, step_sigma^2))` drawn from an rng seeded by (seed, step), one for tokens and one for turns."""
    tokens_per_turn: tuple[tuple[float, float], ...] = ((0.0, 1.0), (1.0, 1.0))
    turns: tuple[tuple[float, float], ...] = ((0.0, 1.0), (1.0, 1.0))
    step_sigma: float = 0.0

    def __post_init__(self):
        for name in ("tokens_per_turn", "turns"):
            knots = getattr(self, name)
            ps = [p for p, _ in knots]
            if len(knots) < 2 or ps != sorted(ps) or ps[0] != 0.0 or ps[-1] != 1.0 or any(f <= 0 for _, f in knots):
                raise ValueError(f"Drift.{name}={knots}: knots (p, factor) with p rising from 0 to 1 and factor > 0")
        if not self.step_sigma >= 0:
            raise ValueError(f"Drift.step_sigma={self.step_sigma} must be >= 0")

    @staticmethod
    def schedule(knots, p: float) -> float:
        p = min(max(p, 0.0), 1.0)
        for (a, fa), (b, fb) in zip(knots, knots[1:]):
            if p <= b:
                return fa + (fb - fa) * ((p - a) / (b - a) if b > a else 1.0)
        return knots[-1][1]

    def factors(self, progress: float, step: int, seed: int) -> tuple[float, float]:
        """(tokens-per-turn factor, turns factor) of the step at `progress`."""
        tokens, turns = self.schedule(self.tokens_per_turn, progress), self.schedule(self.turns, progress)
        if self.step_sigma:
            z = np.random.default_rng([seed, step, 7919]).normal(0.0, self.step_sigma, 2)
            tokens, turns = tokens * math.exp(z[0]), turns * math.exp(z[1])
        return tokens, turns


PARAMETERS = ("model", "accelerator", "devices", "max_turns", "max_context", "prompts_per_step", "group_size",
              "prompt_tokens", "turns", "tokens_per_turn", "observation_tokens", "env_latency_s", "drift")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    source: str  # the paper and the setting this preset follows
    model: str  # a costs.model_shape name (or a costs.ModelShape)
    accelerator: str  # a hardware.accelerator name
    devices: int  # accelerators in the cluster
    max_turns: int  # model turns per task at most
    max_context: int  # tokens per trajectory at most (prompt + generated + observations)
    prompts_per_step: int  # prompts one train step consumes
    group_size: int  # GRPO samples per prompt
    prompt_tokens: Distribution
    turns: Distribution  # model turns a task takes if nothing truncates it
    tokens_per_turn: Distribution  # tokens the model generates per turn
    observation_tokens: Distribution  # tokens an environment observation adds (tool output, image)
    env_latency_s: Distribution  # seconds per environment call (between turns)
    from_paper: tuple[str, ...]  # parameters the paper's settings state
    assumed: tuple[str, ...]  # parameters that are ours
    notes: str = ""
    drift: Drift | None = None  # None: the same distributions all run long
    task_class: str = "agentic"  # the class its tasks carry (one of CLASSES; a mixed workload: its parts')
    # a mixed workload (`mixed`): (class, share, workload) per part; each group draws its tasks from one part.
    # Its own distributions are its multi-turn part's (what the backend's aggregate estimates read)
    parts: tuple[tuple[str, float, "Workload"], ...] = ()

    def __post_init__(self):
        check_workload(self)
        if self.task_class not in CLASSES:
            raise ValueError(f"workload {self.name!r}: task_class={self.task_class!r} is not one of {CLASSES}")
        for cls, share, part in self.parts:
            if cls != part.task_class or not share > 0 or part.parts:
                raise ValueError(f"workload {self.name!r}: part {part.name!r} must be of class {cls!r}, with a "
                                 f"share > 0 (got {share}), and not mixed itself")

    def part(self, rng: np.random.Generator) -> "Workload":
        """The workload one group draws its tasks from: itself, or (mixed) a part chosen by share with `rng`."""
        if not self.parts:
            return self
        shares = np.array([share for _, share, _ in self.parts], float)
        return self.parts[int(rng.choice(len(self.parts), p=shares / shares.sum()))][2]

    def at(self, progress: float, step: int = 0, seed: int = 0) -> "Workload":
        """The workload as it stands at training `progress` (its `drift`; itself without one): the medians
        of tokens per turn and turns scaled, clipped to their ranges."""
        if self.drift is None:
            return self
        f_tokens, f_turns = self.drift.factors(progress, step, seed)
        return dataclasses.replace(self, drift=None, tokens_per_turn=_scaled(self.tokens_per_turn, f_tokens),
                                   turns=_scaled(self.turns, f_turns))


def _scaled(d: Distribution, factor: float) -> Distribution:
    if isinstance(d, Fixed):
        return Fixed(d.value * factor)
    median = min(max(d.median * factor, d.low), d.high)
    return dataclasses.replace(d, median=median if median > 0 else d.median)


def check_workload(w: Workload) -> None:
    """Every parameter stated as the paper's or as ours, exactly once; sizes consistent."""
    listed = list(w.from_paper) + list(w.assumed)
    unknown = sorted(set(listed) - set(PARAMETERS))
    missing = sorted(set(PARAMETERS) - set(listed))
    twice = sorted({p for p in listed if listed.count(p) > 1})
    if unknown or missing or twice:
        raise ValueError(f"workload {w.name!r}: from_paper + assumed must list each of {PARAMETERS} once "
                         f"(unknown {unknown}, missing {missing}, listed twice {twice})")
    for name in ("devices", "max_turns", "max_context", "prompts_per_step", "group_size"):
        if getattr(w, name) < 1:
            raise ValueError(f"workload {w.name!r}: {name}={getattr(w, name)} must be >= 1")
    for name in ("turns", "tokens_per_turn", "prompt_tokens", "observation_tokens", "env_latency_s"):
        if not isinstance(getattr(w, name), (Fixed, ClippedLognormal)):
            raise ValueError(f"workload {w.name!r}: {name} must be a Fixed or ClippedLognormal distribution")
    high_turns = w.turns.value if isinstance(w.turns, Fixed) else w.turns.high
    if high_turns > w.max_turns:
        raise ValueError(f"workload {w.name!r}: turns reach {high_turns} > max_turns={w.max_turns}")


class TaskSample(typing.NamedTuple):  # (a tuple: a 1024-accelerator run makes ~10^6 of them)
    prompt_tokens: int
    gen_tokens: tuple[int, ...]  # per model turn
    obs_tokens: tuple[int, ...]  # per environment call: one between every two turns, none after the last
    env_latency_s: tuple[float, ...]  # per environment call
    truncated: bool  # stopped by max_context
    cls: str = "agentic"  # its workload class (`Workload.task_class`)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + sum(self.gen_tokens) + sum(self.obs_tokens)


def sample_task(w: Workload, rng: np.random.Generator) -> TaskSample:
    """One task's shape: turns of generation separated by environment calls; generation stops at
    `max_context`, and so does an observation that would overflow it (as the real rollout does). A mixed
    workload draws it from one of its parts (`Workload.part`)."""
    w = w.part(rng)
    prompt = int(min(max(1, round(w.prompt_tokens.sample(rng))), w.max_context - 1))
    turns = int(min(max(1, round(w.turns.sample(rng))), w.max_turns))
    context, gen, obs, latency, truncated = prompt, [], [], [], False
    for turn in range(turns):
        tokens = max(1, int(round(w.tokens_per_turn.sample(rng))))
        if context + tokens >= w.max_context:
            gen.append(w.max_context - context)
            truncated = True
            break
        gen.append(tokens)
        context += tokens
        if turn == turns - 1:
            break
        observation = max(0, int(round(w.observation_tokens.sample(rng))))
        if context + observation >= w.max_context:
            truncated = True
            break
        obs.append(observation)
        latency.append(float(w.env_latency_s.sample(rng)))
        context += observation
    return TaskSample(prompt, tuple(gen), tuple(obs), tuple(latency), truncated, w.task_class)


_TIDERL_SOURCE = ("TideRL (settings in docs/mechanisms.md): text-only and multi-modal agentic workloads; the "
                  "settings 7B/14B model, up to 20 turns, up to 8k context on 32 GPUs (text) and up to 50 turns "
                  "(multi-modal) as our record of the paper gives them")
_TEXT_ASSUMED = ("accelerator", "prompts_per_step", "group_size", "prompt_tokens", "turns", "tokens_per_turn",
                 "observation_tokens", "env_latency_s", "drift")


def _tiderl_text(name: str, model: str) -> Workload:
    return Workload(
        name=name, source=_TIDERL_SOURCE, model=model, accelerator="h100", devices=32, max_turns=20,
        max_context=8192, prompts_per_step=32, group_size=8,
        prompt_tokens=ClippedLognormal(median=768, sigma=0.4, low=128, high=4096, integer=True),
        turns=ClippedLognormal(median=6, sigma=0.6, low=1, high=20, integer=True),
        tokens_per_turn=ClippedLognormal(median=192, sigma=0.7, low=8, high=2048, integer=True),
        observation_tokens=ClippedLognormal(median=160, sigma=0.9, low=4, high=2048, integer=True),
        env_latency_s=ClippedLognormal(median=1.5, sigma=1.0, low=0.05, high=120.0),
        from_paper=("model", "devices", "max_turns", "max_context"), assumed=_TEXT_ASSUMED,
        notes="accelerator: the record does not name the GPU; H100 assumed. Tool latency: lognormal with a "
              "1.5 s median and a heavy tail (a few calls take tens of seconds), assumed.")


TIDERL_TEXT_7B = _tiderl_text("tiderl-text-7b", "qwen2.5-7b")
TIDERL_TEXT_14B = _tiderl_text("tiderl-text-14b", "qwen2.5-14b")

TIDERL_MULTIMODAL = Workload(
    name="tiderl-multimodal", source=_TIDERL_SOURCE, model="qwen2.5-7b", accelerator="h100", devices=32,
    max_turns=50, max_context=16384, prompts_per_step=32, group_size=8,
    prompt_tokens=ClippedLognormal(median=1280, sigma=0.4, low=256, high=4096, integer=True),
    turns=ClippedLognormal(median=12, sigma=0.7, low=1, high=50, integer=True),
    tokens_per_turn=ClippedLognormal(median=96, sigma=0.7, low=8, high=1024, integer=True),
    observation_tokens=ClippedLognormal(median=256, sigma=0.5, low=64, high=1280, integer=True),
    env_latency_s=ClippedLognormal(median=2.0, sigma=1.0, low=0.1, high=120.0),
    from_paper=("max_turns",),
    assumed=("model", "accelerator", "devices", "max_context", "prompts_per_step", "group_size", "prompt_tokens",
             "turns", "tokens_per_turn", "observation_tokens", "env_latency_s", "drift"),
    notes="model: the record does not name the vision-language model; the 7B text shape stands in (vision "
          "encoder cost not modelled). Observations carry image tokens (a few hundred per image), assumed.")

BIDIRL_MATH = Workload(
    name="bidirl-math",
    source="BiDiRL (settings in docs/mechanisms.md): asynchronous disaggregated RL on two 32-GPU testbeds; math "
           "RL as our record of the paper gives it",
    model="qwen2.5-7b", accelerator="h100", devices=32, max_turns=1, max_context=8192, prompts_per_step=64,
    group_size=8,
    prompt_tokens=ClippedLognormal(median=160, sigma=0.5, low=32, high=1024, integer=True),
    turns=Fixed(1),
    tokens_per_turn=ClippedLognormal(median=1200, sigma=0.8, low=32, high=8000, integer=True),
    observation_tokens=Fixed(0), env_latency_s=Fixed(0.0), task_class="rlvr",
    from_paper=("devices", "max_turns", "turns", "observation_tokens", "env_latency_s"),
    assumed=("model", "accelerator", "max_context", "prompts_per_step", "group_size", "prompt_tokens",
             "tokens_per_turn", "drift"),
    notes="math RL is single-turn with a rule-based reward: one response per sample, no environment calls. "
          "Long-tailed response lengths (lognormal), assumed.")

_ENV_ASSUMED = ("accelerator", "prompts_per_step", "group_size", "prompt_tokens", "turns", "tokens_per_turn",
                "observation_tokens", "env_latency_s", "drift")
_ENV_SOURCE = ("TideRL's text settings (WebShop, AlfWorld; Qwen2.5-7B, 32 H100, at most 20 turns, 8192 tokens, "
               "environments on a separate CPU cluster); the task shapes are ours, after the environments' kind")

def _agentic_7b(name: str, notes: str, **shapes) -> Workload:
    """A TideRL text environment preset: the paper's model, cluster, turns and context; `shapes` ours."""
    return Workload(name=name, source=_ENV_SOURCE, model="qwen2.5-7b", accelerator="h100", devices=32, max_turns=20,
                    max_context=8192, prompts_per_step=32, group_size=8, from_paper=("model", "devices", "max_turns",
                                                                                     "max_context"),
                    assumed=_ENV_ASSUMED, notes=notes, **shapes)


# WebShop: a shopping site behind a search engine. Short actions (search[...] / click[...] after a short
# thought), long observations (a results or product page as text), slow steps (search + page render on the
# environment cluster). All shapes ours.
WEBSHOP_7B = _agentic_7b(
    "webshop-7b", "WebShop-like: short actions, page-long observations, slow environment steps (ours).",
    prompt_tokens=ClippedLognormal(median=600, sigma=0.3, low=200, high=2048, integer=True),
    turns=ClippedLognormal(median=8, sigma=0.5, low=2, high=20, integer=True),
    tokens_per_turn=ClippedLognormal(median=64, sigma=0.6, low=8, high=1024, integer=True),
    observation_tokens=ClippedLognormal(median=400, sigma=0.6, low=32, high=2048, integer=True),
    env_latency_s=ClippedLognormal(median=2.0, sigma=1.0, low=0.1, high=60.0))

# AlfWorld: a text household simulator. Many short turns (look / go to / take / put), short observations,
# the TextWorld step itself quick but served remotely (a second with the round trip). All shapes ours.
ALFWORLD_7B = _agentic_7b(
    "alfworld-7b", "AlfWorld-like: many short turns, short observations, remote environment steps (ours).",
    prompt_tokens=ClippedLognormal(median=900, sigma=0.2, low=400, high=2048, integer=True),
    turns=ClippedLognormal(median=12, sigma=0.4, low=2, high=20, integer=True),
    tokens_per_turn=ClippedLognormal(median=48, sigma=0.6, low=8, high=512, integer=True),
    observation_tokens=ClippedLognormal(median=60, sigma=0.5, low=8, high=512, integer=True),
    env_latency_s=ClippedLognormal(median=1.0, sigma=0.8, low=0.05, high=30.0))

# The drifting workload (ours): WebShop's shapes, with the policy's behaviour moving over the run as agentic
# RL's does: early many short turns (it flails, calling tools often), then responses lengthen as reasoning
# grows while turns fall (it learns the site), then both settle; every step's batch also differs from the
# last (per-step factors, sigma 0.3). The rollout's load moves between environment waiting, decoding and
# prefill of long contexts, and the trainer's with the batch's tokens, so the bottleneck moves.
WEBSHOP_DRIFT_7B = dataclasses.replace(
    WEBSHOP_7B, name="webshop-drift-7b",
    drift=Drift(tokens_per_turn=((0.0, 0.5), (0.5, 3.0), (1.0, 1.5)), turns=((0.0, 1.8), (0.5, 0.5), (1.0, 0.8)),
                step_sigma=0.3),
    notes="WebShop-like shapes with drifting response lengths and turns plus per-step variance (all ours).")

# The same drift with 8x the prompts per step (ours): 256 prompts of 8 samples, so that the samples in flight fill
# the replicas' decode batches and the rollout's throughput, not only its latency, binds for part of the run (at 32
# prompts the decode batches held 2-6 sequences and the staleness bound held admission throughout).
WEBSHOP_DRIFT_WIDE_7B = dataclasses.replace(
    WEBSHOP_DRIFT_7B, name="webshop-drift-wide-7b", prompts_per_step=256,
    notes="webshop-drift-7b with 256 prompts per step, so rollout throughput binds (all ours).")


def mixed(name: str, source: str, parts: dict[str, tuple[float, Workload]], notes: str = "") -> Workload:
    """A mixed workload: each GRPO group's tasks come from one of `parts` ({class: (share, workload)}), chosen
    with its share (`Workload.part`). The parts must share model, accelerator and devices; the mix's limits are
    the largest of theirs, its own distributions its part with the most turns (what the backend's aggregate
    estimates read: CTB's expected tool latency, ERS's mean context), and a parameter is the paper's only when
    it is in every part."""
    ws = [w for _, w in parts.values()]
    for attr in ("model", "accelerator", "devices"):
        if len({getattr(w, attr) for w in ws}) != 1:
            raise ValueError(f"mixed workload {name!r}: its parts differ in {attr}")
    longest = max(ws, key=lambda w: w.max_turns)
    paper = tuple(p for p in PARAMETERS if all(p in w.from_paper for w in ws))
    return dataclasses.replace(
        longest, name=name, source=source, notes=notes, max_turns=max(w.max_turns for w in ws),
        max_context=max(w.max_context for w in ws), from_paper=paper,
        assumed=tuple(p for p in PARAMETERS if p not in paper),
        parts=tuple((cls, float(share), w) for cls, (share, w) in parts.items()))


# MISA-T's trace ("Scheduling Mixed RL Rollouts Beyond Prefix Locality", settings in docs/mechanisms.md): 128K
# context, 4 replicas at TP 4 on 16 H100 (the Qwen3.6-35B-A3B setting); per request, median (p95) input / output
# tokens: agentic 37,757 (103,209) / 148 (1,612) over 73,659 requests in 1,058 sessions (~70 turns each), RLHF
# 60 (2,564) / 7,344 (24,447), RLVR 156 (1,129) / 47,583 (130,815); tool gaps 22.7% of agent time. Lognormal
# sigmas from median and p95 (sigma = ln(p95 / median) / 1.645). The model is a dense 30B-class stand-in.
_MISA_SOURCE = ("MISA-T (settings in docs/mechanisms.md): the paper's mixed trace at 128K context on 4 x TP4 "
                "H100 replicas; per-class request medians and p95s from the trace, shapes ours")
_MISA_PAPER = ("devices", "max_context", "turns", "tokens_per_turn", "prompt_tokens", "max_turns")
_MISA_OURS = ("model", "accelerator", "prompts_per_step", "group_size", "observation_tokens", "env_latency_s",
              "drift")


def _misa_part(name, cls, notes, **shapes) -> Workload:
    single = shapes["turns"] == Fixed(1)
    paper = tuple(p for p in _MISA_PAPER if not single or p != "max_turns")
    ours = _MISA_OURS + (("max_turns",) if single else ())
    if single:  # single turn: no observation, no tool call (the paper's class definition)
        paper, ours = paper + ("observation_tokens", "env_latency_s"), tuple(
            p for p in ours if p not in ("observation_tokens", "env_latency_s"))
        shapes.update(observation_tokens=Fixed(0), env_latency_s=Fixed(0.0))
    return Workload(name=name, source=_MISA_SOURCE, model="qwen2.5-32b", accelerator="h100", devices=16,
                    max_turns=shapes.pop("max_turns", 1), max_context=131072, prompts_per_step=64, group_size=1,
                    from_paper=paper, assumed=ours, notes=notes, task_class=cls, **shapes)


MISA_T_AGENTIC = _misa_part(
    "misa-t-agentic", "agentic",
    "~70 turns (the trace's requests per session), outputs as the trace's; the first prompt (4k median) and the "
    "observations (420 median) ours, so the median request's context is near the trace's 37.7k; tool latency "
    "(2 s median) ours", max_turns=256,
    prompt_tokens=ClippedLognormal(median=4096, sigma=0.6, low=256, high=32768, integer=True),
    turns=ClippedLognormal(median=60, sigma=0.55, low=1, high=256, integer=True),
    tokens_per_turn=ClippedLognormal(median=148, sigma=1.45, low=1, high=32768, integer=True),
    observation_tokens=ClippedLognormal(median=420, sigma=1.0, low=1, high=16384, integer=True),
    env_latency_s=ClippedLognormal(median=2.0, sigma=1.0, low=0.05, high=120.0))
MISA_T_RLVR = _misa_part(
    "misa-t-rlvr", "rlvr", "single turn, the trace's long outputs",
    prompt_tokens=ClippedLognormal(median=156, sigma=1.2, low=8, high=16384, integer=True), turns=Fixed(1),
    tokens_per_turn=ClippedLognormal(median=47583, sigma=0.61, low=64, high=131072, integer=True))
MISA_T_RLHF = _misa_part(
    "misa-t-rlhf", "rlhf", "single turn, the trace's medium outputs",
    prompt_tokens=ClippedLognormal(median=60, sigma=2.28, low=4, high=16384, integer=True), turns=Fixed(1),
    tokens_per_turn=ClippedLognormal(median=7344, sigma=0.73, low=16, high=131072, integer=True))
MISA_T_MIX = mixed(
    "misa-t-mix", _MISA_SOURCE,
    {"agentic": (PAPER_TARGET["agentic"], MISA_T_AGENTIC), "rlvr": (PAPER_TARGET["rlvr"], MISA_T_RLVR),
     "rlhf": (PAPER_TARGET["rlhf"], MISA_T_RLHF)},
    notes="the MISA-T trace's three classes at the trainer's target mixture (agentic / RLVR / RLHF = 48.6 / 33.1 "
          "/ 18.2 %); a dense 30B-class model stands in for the paper's MoE")

PRESETS = {w.name: w for w in (TIDERL_TEXT_7B, TIDERL_TEXT_14B, TIDERL_MULTIMODAL, BIDIRL_MATH, WEBSHOP_7B,
                               ALFWORLD_7B, WEBSHOP_DRIFT_7B, WEBSHOP_DRIFT_WIDE_7B,
                               MISA_T_AGENTIC, MISA_T_RLVR, MISA_T_RLHF, MISA_T_MIX)}


def drift_sampler(w: Workload, *, groups_per_step: int, steps: int, seed: int, sample_tasks):
    """A `SimBackend.shape_sampler` for a drifting workload: group g is admitted around step
    g // groups_per_step and draws its shapes from `w.at(that step / steps)` with `sample_tasks(w, rng, n)`
    (`sim.backend.sample_tasks`). None when `w` does not drift."""
    if w.drift is None:
        return None

    def sample(group: int, rng: np.random.Generator, n: int):
        step = group // groups_per_step
        return sample_tasks(w.at(step / max(1, steps - 1), step, seed), rng, n)
    return sample


def workload(name: "str | Workload") -> Workload:
    """The preset called `name` (a `Workload` is returned as it is)."""
    if isinstance(name, Workload):
        return name
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown workload {name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[key]
