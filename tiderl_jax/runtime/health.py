"""Training health (docs/outputs.md, docs/glossary.md): is the policy learning? Per update, from the batch's
trajectories and the trainer's step output; JAX-free.

- `batch_stats`: the batch's task reward (mean and spread over its samples), the share of its GRPO groups whose
  rewards are all equal (their advantages are 0: no GRPO signal), response length (model-written tokens per
  sample), turns per sample, tool calls and the share of them that errored, the share of turns whose tool-call
  markup did not parse, and the version lag of its tokens (staleness);
- `check_learning`: the not-learning detector, a pure function of its history (as `policies.ers.decide`): most
  groups (more than ZERO_VARIANCE_SHARE) with zero reward variance, or a zero gradient norm, for
  NOT_LEARNING_UPDATES updates in a row; one warning per episode (the condition must clear to warn again);
- `Monitor`: the controller's per-update call (stats + check, warnings logged);
- `eval_stats`: held-out success of trajectories from an evaluation during RL (`Controller.run(on_step=...)`).

A quantity the trajectories do not record is NaN (the simulator's trajectories carry token counts and versions,
no turns nor tool calls). The check runs only for updates whose trainer reports a gradient norm: a backend that
computes no gradient (the simulator's cost model) or a step that had nothing to train is not checked.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

# "most groups": an update is flagged when more than this share of its GRPO groups have all-equal rewards
ZERO_VARIANCE_SHARE = 0.5
# updates in a row the condition must hold before the warning
NOT_LEARNING_UPDATES = 3
# a gradient norm at or below this is zero (no advantage, no KL or entropy term: exactly 0.0 in float32)
ZERO_GRAD_NORM = 1e-12

NAN = float("nan")


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else NAN


def version_lags(trajectories: Sequence, version: int) -> dict[int, int]:
    """Version lag -> model tokens of the batch, for an update that starts from policy `version` (staleness)."""
    lags: collections.Counter = collections.Counter()
    for t in trajectories:
        for v, n in t.model_version_counts().items():
            lags[version - v] += n
    return dict(lags)


def batch_stats(trajectories: Sequence, lags: Mapping[int, int] | None = None) -> dict[str, float]:
    """The batch's health (module docstring), flat keys as metrics.jsonl holds them: `reward`, `reward_std`
    (population std over the samples), `zero_variance_groups` (share of groups), `response_tokens_mean`,
    `response_tokens_max`, `turns_mean`, `tool_calls_mean` (per sample), `tool_error_rate` (errored calls /
    calls), `malformed_turn_rate` (turns / turns), `staleness_mean` (mean lag of `lags`' tokens)."""
    if not trajectories:
        raise ValueError("batch_stats needs at least one trajectory")
    rewards = [float(t.reward) for t in trajectories]
    mean = sum(rewards) / len(rewards)
    groups: dict[int, list[float]] = {}
    for t, r in zip(trajectories, rewards):
        groups.setdefault(t.group, []).append(r)
    lengths = [t.num_generated for t in trajectories]
    turns = [turn for t in trajectories for turn in t.turns]
    calls = sum(turn.tool_calls for turn in turns)
    tokens = sum((lags or {}).values())
    return dict(
        reward=mean, reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        zero_variance_groups=sum(max(rs) == min(rs) for rs in groups.values()) / len(groups),
        response_tokens_mean=sum(lengths) / len(lengths), response_tokens_max=float(max(lengths)),
        # a finished sample has at least one turn (its answer's): none recorded means none are recorded
        turns_mean=len(turns) / len(trajectories) if turns else NAN,
        tool_calls_mean=calls / len(trajectories) if turns else NAN,
        tool_error_rate=sum(turn.tool_errors for turn in turns) / calls if calls else NAN,
        malformed_turn_rate=sum(turn.malformed for turn in turns) / len(turns) if turns else NAN,
        staleness_mean=sum(lag * n for lag, n in (lags or {}).items()) / tokens if tokens else NAN)


def eval_stats(trajectories: Sequence) -> dict[str, float]:
    """Held-out results of an evaluation during RL: `success` (share of tasks with reward 1), `solved` and
    `tasks` (the counts behind it), `reward` (mean), `turns_mean`, `response_tokens_mean`."""
    if not trajectories:
        raise ValueError("eval_stats needs at least one trajectory")
    solved = sum(t.reward >= 1 for t in trajectories)
    return dict(success=solved / len(trajectories), solved=float(solved), tasks=float(len(trajectories)),
                reward=_mean(t.reward for t in trajectories),
                turns_mean=_mean(len(t.turns) for t in trajectories),
                response_tokens_mean=_mean(t.num_generated for t in trajectories))


@dataclasses.dataclass(frozen=True)
class LearningHistory:
    """`check_learning`'s memory: updates in a row with each condition, and the step each run began."""

    zero_variance_run: int = 0
    zero_variance_since: int = 0
    zero_grad_run: int = 0
    zero_grad_since: int = 0


def check_learning(history: LearningHistory, values: Mapping[str, float], step: int, *,
                   share: float = ZERO_VARIANCE_SHARE,
                   updates: int = NOT_LEARNING_UPDATES) -> tuple[LearningHistory, list[str]]:
    """(new history, warnings) after update `step`, whose `values` hold `zero_variance_groups` (`batch_stats`) and
    the trainer's `grad_norm`. A condition warns once, at the update where it has held `updates` updates in a
    row; it warns again only after an update without it. No `grad_norm` (nothing trained): unchanged, no warning."""
    grad = values.get("grad_norm")
    if grad is None:
        return history, []
    warnings = []
    flat = values.get("zero_variance_groups", NAN) > share
    run = history.zero_variance_run + 1 if flat else 0
    since = history.zero_variance_since if history.zero_variance_run else step
    if run == updates:
        warnings.append(
            f"not learning: in each of updates {since}-{step}, more than {share:.0%} of the GRPO groups had "
            f"all-equal rewards (this update: {values['zero_variance_groups']:.0%}, reward "
            f"{values.get('reward', NAN):.3f}); such groups give zero advantage. The tasks are too hard (or too easy) "
            f"for the policy: a longer warm start, a larger group_size or another task mix gives GRPO a signal")
    zero = math.isfinite(grad) and grad <= ZERO_GRAD_NORM
    grad_run = history.zero_grad_run + 1 if zero else 0
    grad_since = history.zero_grad_since if history.zero_grad_run else step
    if grad_run == updates:
        warnings.append(f"not learning: the gradient norm was 0 in each of updates {grad_since}-{step}, so the "
                        f"policy did not change (all advantages 0, and no KL or entropy term)")
    return LearningHistory(run, since if flat else 0, grad_run, grad_since if zero else 0), warnings


class Monitor:
    """The controller's per-update health: `batch_stats`, then `check_learning` with its warnings logged."""

    def __init__(self, share: float = ZERO_VARIANCE_SHARE, updates: int = NOT_LEARNING_UPDATES):
        self.share, self.updates = share, updates
        self.history = LearningHistory()
        self.warnings: list[tuple[int, str]] = []  # (step, message) of every warning given

    def update(self, step: int, trajectories: Sequence, out: Mapping[str, float],
               lags: Mapping[int, int] | None = None) -> dict[str, float]:
        stats = batch_stats(trajectories, lags)
        self.history, warnings = check_learning(self.history, {**out, **stats}, step, share=self.share,
                                                 updates=self.updates)
        for message in warnings:
            log.warning("%s", message)
            self.warnings.append((step, message))
        return stats
