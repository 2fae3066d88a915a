"""Continuous Task Batching (CTB): task-level KV admission and eviction (TideRL; docs/mechanisms.md).

A stock engine treats each turn of an agentic task as a finished request and frees its KV at every
tool call; the next turn re-prefills the whole, growing context. CTB instead admits *tasks* into a
rank's KV token budget, keeps a waiting task's KV resident (pinned) and resumes it prefilling only
the new observation tokens. These are its decision rules, as pure functions of observed signals:

- `estimate_footprint`: tokens of KV a task will hold: its context now plus the growth of
  `margin_turns` more turns at its mean observed growth per turn (updated after every turn);
  `expected_remaining_turns` gives the margin that reserves a task's whole remaining growth (from
  the turn counts of finished tasks), so admitted tasks rarely need evicting later;
- `admit_tasks`: first come, first served, admit while the footprints fit the budget;
- `task_priority`: `P = w1*is_eval + w2*group_completion + w3*is_active + w4*context_len`
  (eval first, then tasks whose GRPO group is nearly complete, then tasks running now; context
  length breaks ties, its sign configurable: + keeps long contexts, which cost most to recompute);
- `choose_evictions`: under memory pressure, evict waiting tasks' KV, lowest priority first; or,
  readiness-aware (ours), the task expected to wait longest first (it releases memory for longest).
  A task that is generating is never evicted by CTB (the engine's own preemption covers that).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class CTBWeights:
    is_eval: float = 1000.0
    group_completion: float = 100.0
    is_active: float = 10.0
    context_len: float = 0.001  # per token; negative to prefer evicting long contexts


@dataclasses.dataclass(frozen=True)
class TaskKVSignals:
    task_id: int
    is_eval: bool
    group_completion: float  # finished fraction of the task's GRPO group, 0..1
    is_active: bool  # generating now (False while waiting on its environment)
    context_len: int  # tokens of KV the task holds
    expected_wait_s: float = 0.0  # expected remaining environment wait (0 when active)


def task_priority(s: TaskKVSignals, w: CTBWeights = CTBWeights()) -> float:
    return (w.is_eval * s.is_eval + w.group_completion * s.group_completion
            + w.is_active * s.is_active + w.context_len * s.context_len)


def estimate_footprint(context_len: int, turns_done: int, tokens_added: int, *,
                       initial_growth: int = 256, margin_turns: float = 1) -> int:
    """Tokens of KV a task is expected to need soon.

    `tokens_added` is how much the context grew over `turns_done` turns; before the first turn the
    growth per turn is `initial_growth` (a configured guess).
    """
    growth = tokens_added / turns_done if turns_done > 0 else initial_growth
    return int(context_len + margin_turns * growth)


def expected_remaining_turns(turns_done: int, finished_turns: Sequence[int], max_turns: int) -> float:
    """Expected further turns of a task that has done `turns_done` and is still running.

    The mean, over finished tasks that ran more than `turns_done` turns, of the turns they still
    ran; with no such task observed yet, the worst case `max_turns - turns_done` (a prior that
    errs towards admitting fewer tasks rather than evicting admitted ones).
    """
    longer = [n - turns_done for n in finished_turns if n > turns_done]
    if not longer:
        return float(max(0, max_turns - turns_done))
    return min(sum(longer) / len(longer), float(max(0, max_turns - turns_done)))


def admit_tasks(queue: Sequence[tuple[int, int]], *, budget_tokens: int, used_tokens: int) -> list[int]:
    """Task ids to admit from `queue` [(task_id, footprint)], in order, while they fit the budget.

    Stops at the first task that does not fit (no overtaking: a large task is not starved). A task
    is admitted when nothing is in use, whatever its size, so an oversized task still runs.
    """
    admitted = []
    for task_id, footprint in queue:
        if used_tokens > 0 and used_tokens + footprint > budget_tokens:
            break
        admitted.append(task_id)
        used_tokens += footprint
    return admitted


def choose_evictions(tasks: Sequence[TaskKVSignals], need_tokens: int, *,
                     weights: CTBWeights = CTBWeights(), readiness_aware: bool = False) -> list[int]:
    """Waiting tasks whose KV to drop so that at least `need_tokens` are freed (fewest first).

    Order: lowest `task_priority` first; readiness-aware: longest expected wait first (priority
    breaks ties). Returns fewer tasks than needed if the waiting ones do not hold enough.
    """
    if need_tokens <= 0:
        return []
    waiting = [t for t in tasks if not t.is_active and t.context_len > 0]
    if readiness_aware:
        order = sorted(waiting, key=lambda t: (-t.expected_wait_s, task_priority(t, weights)))
    else:
        order = sorted(waiting, key=lambda t: (task_priority(t, weights), -t.expected_wait_s))
    chosen, freed = [], 0
    for t in order:
        if freed >= need_tokens:
            break
        chosen.append(t.task_id)
        freed += t.context_len
    return chosen
