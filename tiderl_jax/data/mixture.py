"""Workload classes and the mixture of them the trainer asks for (docs/data.md, "Workload mixture").

The three classes of MISA-T (`policies.misa_t.CLASSES`) share one rollout service:

- `rlvr`: single turn, long outputs, a verifiable reward (math, code);
- `rlhf`: single turn, medium outputs, scored by a reward model or a rule;
- `agentic`: multi-turn, long contexts, tool gaps between turns.

A class is a task stream plus its turn limits (`ClassSpec`); the trainer asks for a **target mixture** (shares
per class, e.g. the MISA-T paper's agentic / RLVR / RLHF = 48.6 / 33.1 / 18.2), and `MixedTasks` interleaves
the streams so that every prefix of the mixed stream follows the target: task i goes to the class furthest
below its target count `share_b * (i + 1)` (ties: the target's order), so after n tasks every class is within
one task of `share_b * n` (a deterministic, low-discrepancy order: a restart with the same target asks for the
same tasks). Each task carries its class and limits in `Task.data` (`workload_class`, `max_turns`,
`max_new_tokens`), which the rollout (`agents.rollout.turn_limits`, `workload_class`) and the router read.
What the trainer consumed is compared with the target by `misa_t.mixture_deviation`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from tiderl_jax.agents.env import Task
from tiderl_jax.policies.misa_t import CLASSES, PAPER_TARGET

__all__ = ["CLASSES", "PAPER_TARGET", "ClassSpec", "MixedTasks", "class_order", "parse_mixture"]


def parse_mixture(spec: str | Mapping[str, float]) -> dict[str, float]:
    """`"agentic=48.6,rlvr=33.1,rlhf=18.2"` (or a mapping) -> {class: share}, normalised to sum 1, in the order
    given. ValueError naming the problem: an unknown class, a share that is not a non-negative number, a
    repeated class, or nothing positive."""
    if isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"mixture {spec!r}: {part!r} is not class=share")
            try:
                items.append((name.strip(), float(value)))
            except ValueError:
                raise ValueError(f"mixture {spec!r}: share {value.strip()!r} of {name.strip()!r} is not a number") from None
    else:
        items = [(k, float(v)) for k, v in spec.items()]
    seen = set()
    for name, value in items:
        if name not in CLASSES:
            raise ValueError(f"mixture: unknown workload class {name!r} (classes: {', '.join(CLASSES)})")
        if name in seen:
            raise ValueError(f"mixture: class {name!r} given twice")
        if not value >= 0:
            raise ValueError(f"mixture: share {value} of {name!r} must be >= 0")
        seen.add(name)
    total = sum(v for _, v in items)
    if not total > 0:
        raise ValueError(f"mixture {spec!r}: needs at least one class with a positive share")
    return {name: value / total for name, value in items}


def _next_class(target: Mapping[str, float], counts: Mapping[str, int], i: int) -> str:
    """The class of position i given the counts before it: the one furthest below `share * (i + 1)`."""
    names, total = list(target), sum(target.values())
    return max(names, key=lambda b: (target[b] / total * (i + 1) - counts[b], -names.index(b)))


def class_order(target: Mapping[str, float], n: int) -> list[str]:
    """The classes of the first `n` tasks of the mixed stream (module docstring)."""
    counts, out = dict.fromkeys(target, 0), []
    for i in range(n):
        cls = _next_class(target, counts, i)
        counts[cls] += 1
        out.append(cls)
    return out


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    """One class's task stream (task by index within the class) and its limits (None: the rollout config's)."""
    tasks: Callable[[int], Task]
    max_turns: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"workload class {name}={v!r} must be an int >= 1 (or unset)")


class MixedTasks:
    """Task i of the mixed stream: `classes[b].tasks(j)` for the class b of position i and j its count of b
    before i, with its class and limits in `Task.data`. Callable as a controller's `task_source`."""

    def __init__(self, classes: Mapping[str, ClassSpec], target: Mapping[str, float]):
        target = parse_mixture(target)
        missing = [b for b, share in target.items() if share > 0 and b not in classes]
        if missing:
            raise ValueError(f"mixture: classes {missing} have a target share but no task stream")
        self.classes, self.target = dict(classes), {b: s for b, s in target.items() if s > 0}
        self._order: list[str] = []
        self._index: list[int] = []  # task i's index within its class
        self._counts = dict.fromkeys(self.target, 0)

    def class_of(self, i: int) -> str:
        self._extend(i + 1)
        return self._order[i]

    def _extend(self, n: int) -> None:
        while len(self._order) < n:
            cls = _next_class(self.target, self._counts, len(self._order))
            self._order.append(cls)
            self._index.append(self._counts[cls])
            self._counts[cls] += 1

    def __call__(self, i: int) -> Task:
        cls = self.class_of(i)
        spec = self.classes[cls]
        task = spec.tasks(self._index[i])
        data = dict(task.data, workload_class=cls)
        if spec.max_turns is not None:
            data["max_turns"] = spec.max_turns
        if spec.max_new_tokens is not None:
            data["max_new_tokens"] = spec.max_new_tokens
        return dataclasses.replace(task, data=data)
