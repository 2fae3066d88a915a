"""WAR's speculative decoding in the engine: draft, verify in one forward, switch per step on measurements.

A decode step with speculation (`EngineConfig.speculation` "on" or "auto"): every running sequence
drafts up to `spec_tokens` tokens from the suffix index of its draft key (`drafter.py`: its context,
its GRPO group's and its task's earlier sequences), feeds its last token and the drafts in one
forward over the paged KV (`ModelRunner.verify`), and keeps the accepted prefix of the drafts plus one
token drawn by `sampling.verify_drafts`: greedy output is plain decoding's tokens; sampled output has
plain sampling's distribution; every token carries its two log-probs as a plain step's do. KV written
for rejected drafts lies beyond the sequence's length: it is never read and the next step overwrites it.

`SpecSwitch` decides per step (WAR's rule, `policies.war.use_speculation`): off above `spec_max_batch`
sequences; else on when the measured seconds of a speculative step per emitted token are below the
measured seconds of a plain decode step, at the same batch size class and in the same regime: a plain call
runs `decode_steps` steps when nothing else waits (its dispatch and host work amortized over them) but
one step while prefills are pending, and a speculative call always runs one. Measurements are moving
averages of this engine's own steps (host work included: drafting, batching, the device call), and the
acceptance too is measured per batch class (a batch of one drafts from the tail of a long task, a larger
batch from sequences that may be anywhere). A class with no measurement of one kind runs that kind once,
and every `probe_every`-th decision runs the other kind so that both stay current. Steps that compiled a
program are not measured. The measurements are noisy (a shared host, step times of a few ms), so the
switch turns speculation on only when it saves `margin` of a plain step, and turns it off again only when
it no longer saves anything: a measured tie leaves it where it is.
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
    """WAR's per-step speculation switch over measured step times and acceptance."""

    def __init__(self, mode: str, max_batch: int, classes: Sequence[int], probe_every: int = 64,
                 smoothing: float = 0.2, margin: float = war.SPEC_MARGIN):
        self.mode, self.max_batch, self.classes = mode, max_batch, tuple(classes)
        self.probe_every, self.smoothing, self.margin = probe_every, smoothing, margin
        self.t_decode: dict[tuple[int, bool], float] = {}  # (batch class, multi-step) -> seconds per plain step
        self.t_spec: dict[int, float] = {}  # batch class -> seconds per speculative step
        self.accepted: dict[int, float] = {}  # batch class -> tokens emitted per sequence per speculative step
        self.last: war.SpecDecision | None = None
        self._decisions = 0
        self._last_use: dict[int, bool] = {}  # batch class -> what the rule chose last

    def _class(self, batch: int) -> int:
        return bucket(min(batch, self.classes[-1]), self.classes)

    def decide(self, batch: int, multi_step: bool = True) -> bool:
        """Whether this decode step of `batch` sequences speculates (`multi_step`: a plain call would run several
        steps)."""
        if self.mode == "off" or batch < 1 or batch > self.max_batch:
            return False
        if self.mode == "on":
            return True
        c = self._class(batch)
        self._decisions += 1
        if (c, multi_step) not in self.t_decode:
            use = False
        elif c not in self.t_spec:
            use = True
        elif self._decisions % self.probe_every == 0:
            use = not self._last_use.get(c, False)  # refresh the measurement of the kind not chosen lately
        else:
            on = self._last_use.get(c, False)
            self.last = war.use_speculation(batch, self.t_spec[c], self.accepted[c], self.t_decode[c, multi_step],
                                            self.max_batch, margin=0.0 if on else self.margin)
            use = self._last_use[c] = self.last.use
        return use

    def _average(self, table: dict, c: int, value: float) -> None:
        old = table.get(c)
        table[c] = value if old is None else old + self.smoothing * (value - old)

    def record_decode(self, batch: int, multi_step: bool, seconds_per_step: float) -> None:
        if batch <= self.max_batch:
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
        self.spec_switch = SpecSwitch(cfg.speculation, cfg.spec_max_batch, self._spec_row_buckets)

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
        c["spec_emitted"] += c["decode_tokens"] - before
        if not self.runner.compiled:
            self.spec_switch.record_spec(len(batch), time.perf_counter() - t0, int(emitted.sum()) / len(batch))
        return ended
