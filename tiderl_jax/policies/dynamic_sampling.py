"""Dynamic sampling (DAPO, Yu et al. 2025; veRL's `algorithm.filter_groups`): which complete GRPO groups are trained on.

A group whose rewards are all equal (or that has fewer than two samples left) has zero advantage under every group
estimator: it carries no policy gradient, so it is dropped and another sampled in its place. Drops in a row past a
limit mean the tasks are all too hard or all too easy for the policy: the run should stop and say so.
"""

from __future__ import annotations

from typing import Sequence


def informative(rewards: Sequence[float]) -> bool:
    """Whether a complete group's rewards can give a nonzero advantage: at least two different values."""
    return len(set(rewards)) > 1


def exhausted(dropped_in_row: int, limit: int) -> bool:
    """Whether `dropped_in_row` uninformative groups in a row reach `limit`: the run stops."""
    return dropped_in_row >= limit
