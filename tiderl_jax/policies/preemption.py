"""Which sequence gives up its KV pages when the pool is full (engine preemption).

Rule (ours, in the spirit of vLLM's recompute preemption, ordered for agentic workloads):
1. pinned sequences are never chosen (a task waiting on a tool that the scheduler protects);
2. among the rest, idle sequences go before active ones: they need no pages right now; paused ones
   (waiting on a tool) before ready ones (resumed, waiting for a decode slot), which run soon;
3. then the lowest priority (CTB supplies priorities: docs/mechanisms.md);
4. then the latest arrival (the earliest has waited longest and has the most work invested).
The requester itself is a candidate of last resort only when `allow_self` (a decode that cannot
grow preempts itself rather than stall everyone).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class PreemptionCandidate:
    seq_id: int
    priority: float
    arrival: int  # monotone admission counter
    paused: bool
    pinned: bool
    num_pages: int
    ready: bool = False  # idle but queued to run again (resumed or preempted, not yet admitted)


def choose_victim(candidates: Sequence[PreemptionCandidate], requester: int, *,
                  requester_priority: float, requester_arrival: int) -> int | None:
    """The seq_id to preempt for `requester`, or None if nobody may be preempted for it.

    An active sequence is preempted only for a requester that outranks it: higher priority, or
    equal priority and earlier arrival (first come, first served; this also prevents two sequences
    from preempting each other in turn).
    """
    def outranked(c: PreemptionCandidate) -> bool:
        return c.priority < requester_priority or (
            c.priority == requester_priority and c.arrival > requester_arrival)

    eligible = [c for c in candidates
                if c.seq_id != requester and not c.pinned and c.num_pages > 0
                and (c.paused or outranked(c))]
    if not eligible:
        return None
    best = min(eligible, key=lambda c: (not c.paused, c.ready, c.priority, -c.arrival))
    return best.seq_id


def can_admit(missing_pages: int, free_pages: int, reserved_pages: int, num_running: int) -> bool:
    """Memory admission of one waiting sequence (first come, first served, as vLLM's can_allocate).

    Admit when the pool can hold the rest of its context plus a page of decode headroom
    (`missing_pages`) out of the pages not already promised to admitted prefills; an idle engine
    admits anything that fits the pool at all. Admitting more would make running sequences
    preempt each other and recompute.
    """
    return num_running == 0 or missing_pages <= free_pages - reserved_pages
