"""How many prompt tokens an engine step may prefill: static, or P-PAS (docs/mechanisms.md).

Each engine step batches the running decodes with chunks of pending prefills. The decodes always
run (they are limited only by the global token budget); this policy caps the prefill share.

- `static_prefill_budget`: always the same cap (a stock engine's `max_num_batched_tokens`).
- `ppas_prefill_budget` (P-PAS, prefill-pressure adaptive token budget): under *prefill pressure*,
  defined as `num_prefilling >= PRESSURE_MIN_PREFILLS and num_decoding > 0`, use the small cap so
  decodes are not stalled behind long prompts; otherwise the full budget so prompts finish quickly
  when nothing waits on them. The paper uses 2048 vs 16384 tokens on GPUs; the engine scales both
  to its hardware through its config.
"""

from __future__ import annotations

import dataclasses

PRESSURE_MIN_PREFILLS = 2  # P-PAS: at least this many requests prefilling ...
PRESSURE_MIN_DECODES = 1  # ... while at least this many decode


@dataclasses.dataclass(frozen=True)
class PrefillSignals:
    num_prefilling: int  # requests with prompt tokens still to prefill
    num_decoding: int  # requests generating tokens


def static_prefill_budget(signals: PrefillSignals, *, budget: int) -> int:
    del signals
    return budget


def under_prefill_pressure(signals: PrefillSignals) -> bool:
    return (signals.num_prefilling >= PRESSURE_MIN_PREFILLS
            and signals.num_decoding >= PRESSURE_MIN_DECODES)


def ppas_prefill_budget(signals: PrefillSignals, *, full_budget: int, pressure_budget: int) -> int:
    return pressure_budget if under_prefill_pressure(signals) else full_budget


def choose_prefill_budget(policy: str, signals: PrefillSignals, *, full_budget: int,
                          pressure_budget: int) -> int:
    """Dispatch by config name: 'static' (full_budget always) or 'ppas'."""
    if policy == "static":
        return static_prefill_budget(signals, budget=full_budget)
    if policy == "ppas":
        return ppas_prefill_budget(signals, full_budget=full_budget, pressure_budget=pressure_budget)
    raise ValueError(f"prefill budget policy {policy!r} is not one of ('static', 'ppas')")
