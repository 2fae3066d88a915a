"""Workload presets after the papers, and the distributions the simulator samples tasks from.

A `Workload` says what one RL run looks like: model, accelerator, cluster size, batch (prompts x
GRPO group size), and per task: prompt tokens, number of turns, tokens the model generates per
turn, tokens each observation adds, and the environment's latency per tool call. `sample_task`
draws one task's trajectory shape; the simulated rollout replays it turn by turn.

**What is the paper's and what is ours.** Every preset lists each of its parameters in exactly one
of `from_paper` (stated by the paper's settings as our record holds them: the abstracts in
`../shared/seeds/` and the settings issue 8 quotes from the papers) or `assumed` (ours: a plausible
value the record does not give, chosen before any simulation and never adjusted to reach a published
number). `check_workload` enforces the partition. When a paper's full setting becomes available,
replace the assumption and move the field to `from_paper`.

Distributions (all ours in form): lognormal for environment latency (heavy right tail: most tool
calls are quick, a few are slow), for tokens per turn and for turns, clipped to their ranges;
`Fixed` for a constant.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np


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

PARAMETERS = ("model", "accelerator", "devices", "max_turns", "max_context", "prompts_per_step", "group_size",
              "prompt_tokens", "turns", "tokens_per_turn", "observation_tokens", "env_latency_s")


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

    def __post_init__(self):
        check_workload(self)


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

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + sum(self.gen_tokens) + sum(self.obs_tokens)


def sample_task(w: Workload, rng: np.random.Generator) -> TaskSample:
    """One task's shape: turns of generation separated by environment calls; generation stops at
    `max_context`, and so does an observation that would overflow it (as the real rollout does)."""
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
    return TaskSample(prompt, tuple(gen), tuple(obs), tuple(latency), truncated)


_TIDERL_SOURCE = ("TideRL (abstract in ../shared/seeds/): text-only and multi-modal agentic workloads; the "
                  "settings 7B/14B model, up to 20 turns, up to 8k context on 32 GPUs (text) and up to 50 turns "
                  "(multi-modal) as issue 8 quotes them")
_TEXT_ASSUMED = ("accelerator", "prompts_per_step", "group_size", "prompt_tokens", "turns", "tokens_per_turn",
                 "observation_tokens", "env_latency_s")


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
             "turns", "tokens_per_turn", "observation_tokens", "env_latency_s"),
    notes="model: the record does not name the vision-language model; the 7B text shape stands in (vision "
          "encoder cost not modelled). Observations carry image tokens (a few hundred per image), assumed.")

BIDIRL_MATH = Workload(
    name="bidirl-math",
    source="BiDiRL (abstract in ../shared/seeds/): asynchronous disaggregated RL on two 32-GPU testbeds; math "
           "RL as issue 8 quotes it",
    model="qwen2.5-7b", accelerator="h100", devices=32, max_turns=1, max_context=8192, prompts_per_step=64,
    group_size=8,
    prompt_tokens=ClippedLognormal(median=160, sigma=0.5, low=32, high=1024, integer=True),
    turns=Fixed(1),
    tokens_per_turn=ClippedLognormal(median=1200, sigma=0.8, low=32, high=8000, integer=True),
    observation_tokens=Fixed(0), env_latency_s=Fixed(0.0),
    from_paper=("devices", "max_turns", "turns", "observation_tokens", "env_latency_s"),
    assumed=("model", "accelerator", "max_context", "prompts_per_step", "group_size", "prompt_tokens",
             "tokens_per_turn"),
    notes="math RL is single-turn with a rule-based reward: one response per sample, no environment calls. "
          "Long-tailed response lengths (lognormal), assumed.")

PRESETS = {w.name: w for w in (TIDERL_TEXT_7B, TIDERL_TEXT_14B, TIDERL_MULTIMODAL, BIDIRL_MATH)}


def workload(name: "str | Workload") -> Workload:
    """The preset called `name` (a `Workload` is returned as it is)."""
    if isinstance(name, Workload):
        return name
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown workload {name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[key]
