"""WAR's speculative decoding in the engine: draft, verify in one forward, switch per step on measurements.

A decode step with speculation (`EngineConfig.speculation` "on" or "auto"): every running sequence
drafts up to `spec_tokens` tokens from the suffix index of its draft key (`drafter.py`: its context,
its GRPO group's and its task's earlier sequences), feeds its last token and the drafts in one
forward over the paged KV (`ModelRunner.verify`), and keeps the accepted prefix of the drafts plus one
token drawn by `sampling.verify_drafts`: greedy output is plain decoding's tokens; sampled output has
plain sampling's distribution; every token carries its two log-probs as a plain step's do. KV written
for rejected drafts lies beyond the sequence's length: it is never read and the next step overwrites it.

`SpecSwitch` measures and `policies.war.switch_speculation` decides per step (WAR's rule with our probes and
hysteresis: its docstring): off above `spec_max_batch` sequences; else on when the measured seconds of a
speculative step per emitted token are below the measured seconds of a plain decode step, at the same batch size
class and in the same regime: a plain call runs `decode_steps` steps when nothing else waits (its dispatch and
host work amortized over them) but one step while prefills are pending, and a speculative call always runs one.
Measurements are moving averages of this engine's own steps (host work included: drafting, batching, the device
call), and the acceptance too is measured per batch class (a batch of one drafts from the tail of a long task, a
larger batch from sequences that may be anywhere): the tokens a step emitted, up to and including a stop token.
Steps that compiled a program are not measured.
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import numpy as np

from tiderl_jax.engine.buckets import bucket, pow2_buckets
from tiderl_jax.engine.drafter import Drafter
from tiderl_jax.engine.requests import _Seq
from tiderl_jax.policies import war


class SpecSwitch:
    """WAR's per-step speculation switch: this engine's measurements per batch class; `war.switch_speculation`
    decides on them."""

    def __init__(self, mode: str, classes: Sequence[int], config: war.SpecSwitchConfig = war.SpecSwitchConfig()):
        self.mode, self.classes, self.config = mode, tuple(classes), config
        self.t_decode: dict[tuple[int, bool], float] = {}  # (batch class, multi-step) -> seconds per plain step
        self.t_spec: dict[int, float] = {}  # batch class -> seconds per speculative step
        self.accepted: dict[int, float] = {}  # batch class -> tokens emitted per sequence per speculative step
        self.history: dict[int, war.SpecClassHistory] = {}  # batch class -> the policy's state
        self.last: war.SpecDecision | None = None

    def _class(self, batch: int) -> int:
        return bucket(min(batch, self.classes[-1]), self.classes)

    def decide(self, batch: int, multi_step: bool = True) -> bool:
        """Whether this decode step of `batch` sequences speculates (`multi_step`: a plain call would run several
        steps)."""
        if self.mode == "off" or not 1 <= batch <= self.config.max_batch:
            return False
        if self.mode == "on":
            return True
        c = self._class(batch)
        use, self.history[c], decision = war.switch_speculation(
            batch, self.t_decode.get((c, multi_step)), self.t_spec.get(c), self.accepted.get(c),
            self.history.get(c, war.SpecClassHistory()), self.config)
        if decision is not None:
            self.last = decision
        return use

    def _average(self, table: dict, c: Hashable, value: float) -> None:
        old = table.get(c)
        table[c] = value if old is None else old + self.config.smoothing * (value - old)

    def record_decode(self, batch: int, multi_step: bool, seconds_per_step: float) -> None:
        if batch <= self.config.max_batch:
            self._average(self.t_decode, (self._class(batch), multi_step), seconds_per_step)

    def record_spec(self, batch: int, seconds: float, emitted_per_seq: float) -> None:
        self._average(self.t_spec, self._class(batch), seconds)
        self._average(self.accepted, self._class(batch), emitted_per_seq)


class SpeculativeDecoding:
    """The engine's speculative decode step (a mixin of `Engine`)."""

    def _init_speculation(self) -> None:
        cfg = self.config
        self.drafter = Drafter(max_tokens=cfg.draft_max_tokens)
        self._spec_row_buckets = pow2_buckets(1, min(cfg.spec_max_batch, cfg.max_running), cfg.bucket_growth)
        self.spec_switch = SpecSwitch(cfg.speculation, self._spec_row_buckets,
                                      war.SpecSwitchConfig(max_batch=cfg.spec_max_batch))

    def add_draft(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Indexes an earlier sequence (a trajectory of the task) for sequences submitted under `draft_key=key`."""
        self.drafter.add(key, [int(t) for t in tokens])

    def _speculate(self, batch: int, steps: int) -> bool:
        return self.spec_switch.decide(batch, min(steps, self.config.decode_steps) > 1)

    def _spec_programs(self) -> list:
        if self.config.speculation == "off":
            return []
        width = 1 + self.config.spec_tokens
        return [("verify", (rows, width), (rows, pages)) for rows in self._spec_row_buckets
                for pages in self._prefill_page_buckets]

    def _draft(self, s: _Seq, k: int) -> list[int]:
        key = s.draft_key
        s.indexed = min(s.indexed, len(s.tokens))  # a rolled-back turn
        if s.indexed < len(s.tokens):
            self.drafter.extend(key, s.tokens[:s.indexed], s.tokens[s.indexed:])
            s.indexed = len(s.tokens)
        return self.drafter.draft(key, s.tokens, k)

    def _run_verify(self, batch: list[_Seq], t0: float) -> list[int]:
        """One speculative step for `batch` (pages for 1 + spec_tokens more tokens each already held)."""
        k = self.config.spec_tokens
        rows = bucket(len(batch), self._spec_row_buckets)
        tokens = np.zeros((rows, 1 + k), np.int32)
        num_drafts = np.zeros(rows, np.int32)
        for i, s in enumerate(batch):
            remaining = min(s.sampling.max_new_tokens - s.turn_generated, self.config.max_seq_len - len(s.tokens))
            drafts = self._draft(s, min(k, remaining - 1))
            tokens[i, 0] = s.tokens[-1]
            tokens[i, 1:1 + len(drafts)] = drafts
            num_drafts[i] = len(drafts)
        starts = np.asarray([len(s.tokens) - 1 for s in batch] + [0] * (rows - len(batch)), np.int32)
        live = np.arange(rows) < len(batch)
        temp, top_k, top_p, seeds, index, filtered = self._sampling_arrays(batch, rows)
        tok, lps, lpm, emitted = self.runner.verify(
            tokens, self._page_table(batch, rows, self._prefill_page_buckets), starts, num_drafts, live,
            temp, top_k, top_p, seeds, index, filtered=filtered)
        c = self._counters
        c["decode_calls"] += 1
        c["spec_steps"] += 1
        c["spec_rows"] += len(batch)
        c["spec_drafted"] += int(num_drafts.sum())
        before, now = c["decode_tokens"], time.perf_counter()
        ended = [s.id for i, s in enumerate(batch)
                 if self._emit(s, tok[i, :emitted[i]], lps[i, :emitted[i]], lpm[i, :emitted[i]], now)]
        kept = c["decode_tokens"] - before  # up to and including a stop: drafts verified past it are not emitted
        c["spec_emitted"] += kept
        if not self.runner.compiled:
            self.spec_switch.record_spec(len(batch), time.perf_counter() - t0, kept / len(batch))
        return ended
