"""The rollout engine: continuous batching of many sequences over a paged KV pool.

```
 submit / submit_group ──► waiting ──admit──► prefilling ──(chunks under the step budget)──► running
                              ▲                    │ (prefix-cache hits and forks skip tokens)   │
                              │ preempted           ▼                                            ▼
 resume(new_tokens) ◄──── paused (keeps KV) ◄── end of turn (keep_kv) ◄── stop id / max_new_tokens
                                                    └──────── end of turn (no keep_kv) ──► finished
```

`step()` is one scheduling round: admit waiting sequences into free slots (prefix-cache lookup,
or a fork of the group leader's prompt pages), take chunks of pending prefills up to the prefill
budget (a policy in `tiderl_jax/policies/prefill_budget.py`: static or P-PAS), run one ragged prefill
program per chunk-length bucket (the chunks' tokens packed back to back), then one decode program for every
running sequence: K steps at once when nothing else waits, one step otherwise, so prefills interleave with
decodes. With speculation (WAR,
`speculation.py`), a decode step drafts tokens per sequence and verifies them in one forward instead.

Memory: pages are allocated as sequences grow. When none is left, the preemption policy
(`tiderl_jax/policies/preemption.py`) picks a victim whose KV is **dropped and recomputed** when it
runs again. We recompute rather than copy to host memory because on CPU host and device memory are
the same memory, and on accelerators the victim's full blocks stay in the prefix cache (LRU), so the
recompute mostly hits the cache when memory frees up soon; the rest is one fast prefill.

Weights: `update_params(params, version)` swaps the parameters between steps. Every generated token
records the version that produced it. In-flight sequences continue on the new weights
(`on_update="continue"`, as AReaL) or are rolled back to the start of their turn and rerun
(`"abort"`); prefix-cache blocks are keyed by the weights they were computed with (each
`update_params` call, whatever version it names: a warm start loaded twice under version 0 must not
serve the first weights' KV), so older ones are not reused unless `reuse_stale_prefix_cache`.

Images (vision models): a request, or a resume, may add tokens holding images (`vision.ImageSpan`,
offsets relative to the tokens it adds). The sequence keeps them by absolute position on the host;
every prefill chunk (first prefill, recompute after preemption, resume) feeds the patches of its
positions, and prefix-cache keys hash the image content, so only identical images share KV. Decode
feeds sampled tokens only: a sampled image placeholder id is text (its token embedding).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from tiderl_jax.engine.config import EngineConfig  # noqa: F401 (re-exported)
from tiderl_jax.engine.kv_pages import OutOfPages, PagePool, block_key
from tiderl_jax.engine.runner import ModelRunner, bucket, half_pow2_buckets, pow2_buckets
from tiderl_jax.engine.requests import Request, SequenceOutput, Status, _Seq  # noqa: F401 (re-exported)
from tiderl_jax.engine.speculation import SpeculativeDecoding
from tiderl_jax.engine.sampling import RequestError, SamplingParams, stop_matrix
from tiderl_jax.model import vision
from tiderl_jax.model.decoder import Decoder
from tiderl_jax.model.vision import ImageSpan
from tiderl_jax.policies.preemption import PreemptionCandidate, can_admit, choose_victim
from tiderl_jax.policies.prefill_budget import PrefillSignals, choose_prefill_budget


class Engine(SpeculativeDecoding):
    """submit / step / pause / resume / abort / update_params / stats over one model replica."""

    def __init__(self, model: Decoder, config: EngineConfig = EngineConfig(), *, version: int = 0):
        self.config = config
        self.model_cfg = model.cfg
        self.runner = self._new_runner(model)
        self.pool = PagePool(config.num_pages, config.page_size)
        self.version = version
        self._weights = 0  # weight swaps so far: what prefix-cache blocks are keyed by (`_cache_version`)
        self._seqs: dict[int, _Seq] = {}
        self._ended_early: list[int] = []  # turns `end_turn` ended, reported by the next step
        self._next_id = 0
        self._arrivals = 0
        max_pages = config.max_seq_len // config.page_size
        # Decode reads its whole attention span every step: fine buckets. A prefill's span costs
        # little next to its chunk: coarse ones (fewer programs to compile).
        g = config.bucket_growth
        self._page_buckets = (half_pow2_buckets(min(4, max_pages), max_pages) if g == 2
                              else pow2_buckets(min(4, max_pages), max_pages, 4))
        self._prefill_page_buckets = pow2_buckets(min(4, max_pages), max_pages, g)
        self._row_buckets = pow2_buckets(min(8, config.max_running), config.max_running, g)
        self._prefill_row_buckets = pow2_buckets(1, min(config.max_prefill_rows, config.max_running), g)
        self._chunk_buckets = pow2_buckets(min(16, config.prefill_chunk), config.prefill_chunk, g)
        # a ragged prefill call's token counts: the chunk buckets, then powers of two up to the most a call takes
        most = min(config.prefill_budget, self._prefill_row_buckets[-1] * config.prefill_chunk)
        self._token_buckets = tuple(sorted(set(self._chunk_buckets) | set(
            pow2_buckets(self._chunk_buckets[-1], max(most, self._chunk_buckets[-1])))))
        self._compile_s_before_move = 0.0  # compile seconds of runners replaced by `move_to`
        self._counters = dict(steps=0, prefill_calls=0, decode_calls=0, prompt_tokens=0,
                              prompt_tokens_cached=0, prefill_tokens_computed=0, decode_tokens=0,
                              preemptions=0, evictions=0, requests=0, rejected=0, param_updates=0,
                              spec_steps=0, spec_rows=0, spec_drafted=0, spec_emitted=0)
        self._init_speculation()
        self._t0 = time.perf_counter()

    # ================================================================== public API

    def submit(self, request: Request) -> int:
        """Queues a request; returns its handle. Bad requests raise RequestError (nothing queued)."""
        return self._add(request, parent=None, seed_offset=0)

    def submit_group(self, request: Request, n: int) -> list[int]:
        """G samples of one prompt: the prompt is prefilled once and its pages are shared (forked).

        Sample i uses seed `request.sampling.seed + i`.
        """
        if n < 1:
            raise RequestError(f"group size n={n} must be >= 1")
        leader = self._add(request, parent=None, seed_offset=0)
        followers = [self._add(request, parent=leader, seed_offset=i) for i in range(1, n)]
        for h in followers:  # one suffix index for the group; the shared prompt indexed once
            f = self._seqs[h]
            f.draft_key, f.indexed = self._seqs[leader].draft_key, len(f.tokens)
        return [leader] + followers

    def pause(self, handle: int) -> None:
        """Stops generating for `handle` and frees its slot; its KV pages stay (it can resume)."""
        seq = self._get(handle)
        if seq.status in (Status.FINISHED, Status.ABORTED):
            raise RequestError(f"request {handle} has ended ({seq.status.value}); it cannot pause")
        seq.status = Status.PAUSED

    def resume(self, handle: int, new_tokens: Sequence[int] = (), *,
               sampling: SamplingParams | None = None, images: Sequence[ImageSpan] = ()) -> None:
        """Appends `new_tokens` (e.g. a tool's observation) and starts a new turn.

        `images`: the images among `new_tokens` (offsets into `new_tokens`). Only the tokens whose
        KV is not cached are prefilled: the new ones (and the last sampled token), unless the
        sequence was preempted while paused.
        """
        seq = self._get(handle)
        if seq.status != Status.PAUSED:
            raise RequestError(f"request {handle} is {seq.status.value}, not paused; cannot resume")
        new_tokens = list(new_tokens)
        sampling = sampling or seq.sampling
        sampling.validate(self.config.max_stop_ids)
        self._check_tokens(new_tokens, what=f"resume tokens of request {handle}", allow_empty=True)
        self._check_images(new_tokens, images, what=f"resume images of request {handle}")
        total = len(seq.tokens) + len(new_tokens) + sampling.max_new_tokens
        if total > self.config.max_seq_len:
            raise RequestError(
                f"request {handle}: context {len(seq.tokens)} + {len(new_tokens)} new tokens + "
                f"max_new_tokens {sampling.max_new_tokens} exceeds max_seq_len {self.config.max_seq_len}")
        self._check_fits_pool(total, f"request {handle}: context + new tokens + max_new_tokens")
        seq.turn_start = len(seq.tokens)
        seq.images += sorted((im.shifted(len(seq.tokens)) for im in images), key=lambda im: im.offset)
        self._append(seq, new_tokens, generated=False)
        seq.sampling = sampling
        seq.turn_generated = 0
        seq.finish_reason = None
        seq.status = Status.WAITING
        seq.looked_up = False
        seq.arrival = self._arrival()

    def abort(self, handle: int) -> None:
        seq = self._get(handle)
        if seq.status in (Status.FINISHED, Status.ABORTED):
            return
        self._drop_kv(seq)
        seq.status, seq.finish_reason = Status.ABORTED, "abort"
        seq.finish_time = time.perf_counter()

    def end_turn(self, handle: int) -> bool:
        """Ends a running turn now, as a stop token would (a caller's stop string appeared): paused with its KV
        when it keeps it, else finished; the next `step()` reports it. False when it was not running."""
        s = self._get(handle)
        if s.status != Status.RUNNING or not s.turn_generated:
            return False
        self._close_turn(s, "stop", time.perf_counter())
        self._ended_early.append(handle)
        return True

    def release(self, handle: int) -> None:
        """Ends a paused sequence; its full blocks stay in the prefix cache."""
        seq = self._get(handle)
        if seq.status == Status.PAUSED:
            self._drop_kv(seq)
            seq.status = Status.FINISHED

    def evict(self, handle: int) -> None:
        """Drops a paused sequence's KV now (it is recomputed on resume): the caller's eviction."""
        seq = self._get(handle)
        if seq.status != Status.PAUSED:
            raise RequestError(f"request {handle} is {seq.status.value}; only paused sequences are evicted")
        if seq.pages:
            self._drop_kv(seq)
            self._counters["evictions"] += 1

    def num_kv_tokens(self, handle: int) -> int:
        """Tokens of KV the sequence holds now."""
        return self._get(handle).num_computed

    def pending_kv_tokens(self, handle: int) -> int:
        """Tokens of KV the sequence still has to add in its current turn (context not yet
        computed plus its remaining new tokens); 0 unless it is waiting, prefilling or running."""
        s = self._get(handle)
        if s.status not in (Status.WAITING, Status.PREFILLING, Status.RUNNING):
            return 0
        return len(s.tokens) - s.num_computed + s.sampling.max_new_tokens - s.turn_generated

    def free_kv_tokens(self) -> int:
        """Tokens of KV obtainable without preempting anyone (free + evictable cached pages)."""
        return self.pool.num_free * self.config.page_size

    def load(self) -> dict:
        """What a router reads of this engine, in one pass: `running` (prefilling or decoding) and `waiting`
        sequences, `queued_tokens` (context of the waiting ones not computed yet) and `pinned_kv_tokens` (KV held
        by pinned sequences: tasks waiting on a tool)."""
        out = dict(running=0, waiting=0, queued_tokens=0, pinned_kv_tokens=0)
        for s in self._seqs.values():
            if s.status in (Status.PREFILLING, Status.RUNNING):
                out["running"] += 1
            elif s.status == Status.WAITING:
                out["waiting"] += 1
                out["queued_tokens"] += len(s.tokens) - s.num_computed
            if s.pinned and s.pages:
                out["pinned_kv_tokens"] += s.num_computed
        return out

    def cached_prefix_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens at the start of `tokens` whose KV this engine's prefix cache holds now (whole blocks, never the
        last token, as a submit would find them; text only: blocks holding images are not matched). Reads the
        cache without touching it (no LRU refresh, no reference taken)."""
        if not self.config.enable_prefix_cache:
            return 0
        ps, parent, hits = self.config.page_size, None, 0
        for i in range((len(tokens) - 1) // ps):
            key = block_key(parent, tokens[i * ps:(i + 1) * ps], self._cache_version(), b"")
            if not self.pool.contains(key):
                break
            parent, hits = key, hits + 1
        return hits * ps

    def pin(self, handle: int) -> None:
        """Exempts the sequence's KV from preemption (a task waiting on a tool keeps its context)."""
        self._get(handle).pinned = True

    def unpin(self, handle: int) -> None:
        self._get(handle).pinned = False

    def forget(self, handle: int) -> None:
        """Drops an ended sequence's record (call once its output has been read)."""
        seq = self._get(handle)
        if seq.status not in (Status.FINISHED, Status.ABORTED):
            raise RequestError(f"request {handle} is {seq.status.value}; abort or release it first")
        del self._seqs[handle]

    def update_params(self, params, version: int) -> None:
        """Swaps in new weights (an nnx.State of the same model), effective from the next step."""
        self.runner.set_params(params)
        self.version = version
        self._weights += 1  # a new key space for the prefix cache, even under the same version
        self._counters["param_updates"] += 1
        if self.config.on_update == "abort":
            for seq in self._seqs.values():
                if seq.status in (Status.WAITING, Status.PREFILLING, Status.RUNNING):
                    self._rollback_turn(seq)
                if seq.status == Status.PAUSED:
                    self._drop_kv(seq)

    def move_to(self, model: Decoder) -> None:
        """Continues on `model`'s devices (a rollout mesh that gained or lost a device group).

        Call between steps. The page pools are rebuilt there, so every sequence's KV is dropped (the
        prefix cache too): running ones go back to waiting and recompute, paused ones recompute on
        resume. Sequences, their tokens and log-probs are untouched.
        """
        for seq in self._seqs.values():
            seq.pages, seq.block_keys, seq.num_computed, seq.looked_up = [], [], 0, False
            if seq.status in (Status.PREFILLING, Status.RUNNING):
                seq.status = Status.WAITING
        self._compile_s_before_move += self.runner.compile_s
        self.runner = self._new_runner(model)
        self.pool = PagePool(self.config.num_pages, self.config.page_size)
        self._counters["moves"] = self._counters.get("moves", 0) + 1

    def _new_runner(self, model: Decoder) -> ModelRunner:
        c = self.config
        return ModelRunner(model, num_pages=c.num_pages, page_size=c.page_size, attention_impl=c.attention_impl,
                           max_stop_ids=c.max_stop_ids)

    @property
    def compile_s(self) -> float:
        """Wall seconds spent compiling device programs, over every mesh this engine ran on."""
        return self._compile_s_before_move + self.runner.compile_s

    def get(self, handle: int) -> SequenceOutput:
        s = self._get(handle)
        return SequenceOutput(
            handle=s.id, status=s.status, finish_reason=s.finish_reason, tokens=list(s.tokens),
            model_mask=list(s.model_mask), logp_sample=list(s.logp_sample),
            logp_model=list(s.logp_model), versions=list(s.versions), turn_start=s.turn_start,
            ttft_s=None if s.first_token_time is None else s.first_token_time - s.submit_time,
            latency_s=None if s.finish_time is None else s.finish_time - s.submit_time,
            images=tuple(s.images))

    def has_work(self) -> bool:
        return bool(self._ended_early) or any(s.status in (Status.WAITING, Status.PREFILLING, Status.RUNNING)
                   for s in self._seqs.values())

    def stats(self) -> dict:
        c = dict(self._counters)
        by_status = {st.value: 0 for st in Status}
        for s in self._seqs.values():
            by_status[s.status.value] += 1
        c.update({f"num_{k}": v for k, v in by_status.items()})
        c["prefix_hit_rate"] = c["prompt_tokens_cached"] / max(1, c["prompt_tokens"])
        c["spec_acceptance_length"] = c["spec_emitted"] / max(1, c["spec_rows"])  # tokens per sequence and step
        c.update(pages_total=self.pool.num_pages - 1, pages_used=self.pool.num_used,
                 pages_cached=self.pool.num_cached, pages_free=self.pool.num_free - self.pool.num_cached,
                 prefix_evictions=self.pool.evictions, compilations=self.runner.compile_count(),
                 compile_s=self.compile_s,
                 version=self.version, uptime_s=time.perf_counter() - self._t0)
        return c

    def warmup(self, programs=None, threads: int = 1) -> float:
        """Compiles every device program the engine can ask for (`grid()`), or only `programs`: the shape keys an
        engine of the same config ran (`programs()`: what a rerun will ask for, without the whole grid), `threads`
        at a time (on 2 CPU cores XLA's own threads already use both: 2 gained nothing there); returns seconds. After the full warm-up no traffic within the configured limits compiles anything.
        """
        return self.runner.warm(self.grid() if programs is None else programs, threads)

    def grid(self) -> list:
        """The shape keys of every program traffic within the configured limits can run: decode (rows x attention
        span), prefill (rows x chunk width x packed tokens x span, without the spans too short for the chunk: a
        chunk in width bucket w has more tokens than the bucket below w, so its span holds at least that many, and
        without the packed sizes too small for that many tokens in that many rows) and, with speculation, verify
        (rows x span)."""
        keys = [("decode", (rows,), (rows, pages), self.config.decode_steps)
                for rows in self._row_buckets for pages in self._page_buckets]
        ps, top = self.config.page_size, self._token_buckets[-1]  # sizes a call's tokens can take
        for i, width in enumerate(self._chunk_buckets):
            shortest = self._chunk_buckets[i - 1] + 1 if i else 1
            for j, rows in enumerate(self._prefill_row_buckets):
                fewest = self._prefill_row_buckets[j - 1] + 1 if j else 1
                keys += [("prefill", (rows, width), (rows, pages), n) for n in self._packed_sizes(rows, width)
                         if n >= min(fewest * shortest, top)
                         for pages in self._prefill_page_buckets if pages * ps >= shortest
                         or pages == self._prefill_page_buckets[-1]]
        return keys + self._spec_programs()

    def programs(self) -> frozenset:
        """The shape keys of the device programs this engine has run (`warmup(programs)` of another engine)."""
        return frozenset(self.runner._programs)

    def num_programs(self) -> int:
        """Size of the shape-bucket grid `warmup` compiles."""
        return len(self.grid())

    def step(self) -> list[int]:
        """One scheduling round; returns the handles whose turn ended (finished or paused)."""
        self._counters["steps"] += 1
        ended, self._ended_early = self._ended_early, []
        self._admit()
        chunks = self._plan_prefill()
        prefilling_left = any(s.status == Status.PREFILLING and s.num_computed + n < len(s.tokens)
                              for s, n in chunks)
        waiting = any(s.status == Status.WAITING for s in self._seqs.values())
        if chunks:
            ended += self._run_prefill(chunks)
        steps = 1 if (chunks or prefilling_left or waiting) else self.config.decode_steps
        ended += self._run_decode(steps)
        return ended

    def run(self, handles: Sequence[int] | None = None, max_steps: int = 1_000_000) -> None:
        """Steps until the given handles (default: all) are no longer waiting, prefilling or running."""
        active = (Status.WAITING, Status.PREFILLING, Status.RUNNING)
        for _ in range(max_steps):
            seqs = self._seqs.values() if handles is None else [self._seqs[h] for h in handles]
            if not any(s.status in active for s in seqs):
                return
            self.step()
        raise RuntimeError(f"engine did not finish within {max_steps} steps")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
                 ) -> list[SequenceOutput]:
        """Convenience: submit prompts, run to completion, return and forget their outputs."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        handles = [self.submit(Request(p, s)) for p, s in zip(prompts, sampling)]
        self.run(handles)
        out = [self.get(h) for h in handles]
        for h in handles:
            self.forget(h)
        return out

    # ================================================================== bookkeeping

    def _arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def _get(self, handle: int) -> _Seq:
        try:
            return self._seqs[handle]
        except KeyError:
            raise RequestError(f"unknown request handle {handle}") from None

    def _check_tokens(self, tokens: Sequence[int], *, what: str, allow_empty: bool = False) -> None:
        if not tokens and not allow_empty:
            raise RequestError(f"{what} is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in tokens if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"{what} holds token ids {bad[:4]} outside [0, {vocab})")

    def _check_images(self, tokens: Sequence[int], images: Sequence[ImageSpan], *, what: str) -> None:
        try:
            vision.check_images(tokens, images, self.model_cfg)
        except ValueError as e:
            raise RequestError(f"{what}: {e}") from None

    def _check_fits_pool(self, tokens: int, what: str) -> None:
        """A sequence that cannot fit the whole pool would stall the engine: refuse it up front."""
        capacity = (self.pool.num_pages - 1) * self.config.page_size
        if tokens > capacity:
            raise RequestError(f"{what} = {tokens} tokens exceeds the KV pool's {capacity} tokens "
                               f"({self.pool.num_pages - 1} pages of {self.config.page_size})")

    def _add(self, request: Request, *, parent: int | None, seed_offset: int) -> int:
        try:
            request.sampling.validate(self.config.max_stop_ids)
            if request.sample_offset < 0:
                raise RequestError(f"sample_offset={request.sample_offset} must be >= 0")
            prompt = list(request.prompt)
            self._check_tokens(prompt, what="prompt")
            self._check_images(prompt, request.images, what="prompt images")
            need = len(prompt) + request.sampling.max_new_tokens
            if need > self.config.max_seq_len:
                raise RequestError(
                    f"prompt of {len(prompt)} tokens + max_new_tokens {request.sampling.max_new_tokens}"
                    f" exceeds the engine's max_seq_len {self.config.max_seq_len}")
            self._check_fits_pool(need, f"prompt of {len(prompt)} tokens + max_new_tokens "
                                        f"{request.sampling.max_new_tokens}")
        except RequestError:
            self._counters["rejected"] += 1
            raise
        sampling = dataclasses.replace(request.sampling, seed=request.sampling.seed + seed_offset)
        seq = _Seq(id=self._next_id, tokens=[], model_mask=[], logp_sample=[], logp_model=[],
                   versions=[], sampling=sampling, priority=request.priority,
                   keep_kv=request.keep_kv, arrival=self._arrival(), parent=parent,
                   submit_time=time.perf_counter(), num_sampled=request.sample_offset,
                   images=sorted(request.images, key=lambda im: im.offset))
        seq.draft_key = request.draft_key if request.draft_key is not None else ("sequence", seq.id)
        self._append(seq, prompt, generated=False)
        self._seqs[seq.id] = seq
        self._next_id += 1
        self._counters["requests"] += 1
        return seq.id

    def _append(self, seq: _Seq, tokens: Sequence[int], *, generated: bool,
                logp_sample: Sequence[float] = (), logp_model: Sequence[float] = ()) -> None:
        n = len(tokens)
        seq.tokens.extend(int(t) for t in tokens)
        seq.model_mask.extend([generated] * n)
        seq.logp_sample.extend(logp_sample if generated else [0.0] * n)
        seq.logp_model.extend(logp_model if generated else [0.0] * n)
        seq.versions.extend([self.version if generated else -1] * n)

    def _cache_version(self) -> int:
        return 0 if self.config.reuse_stale_prefix_cache else self._weights

    def _drop_kv(self, seq: _Seq) -> None:
        for page in seq.pages:
            self.pool.release(page)
        seq.pages, seq.block_keys, seq.num_computed = [], [], 0
        seq.looked_up = False

    def _rollback_turn(self, seq: _Seq) -> None:
        """Discards what the current turn generated and its KV; the sequence reruns the turn."""
        keep = seq.turn_start + next((i for i, m in enumerate(seq.model_mask[seq.turn_start:]) if m),
                                     len(seq.tokens) - seq.turn_start)
        for field in ("tokens", "model_mask", "logp_sample", "logp_model", "versions"):
            del getattr(seq, field)[keep:]
        seq.num_sampled -= seq.turn_generated
        seq.turn_generated = 0
        self._drop_kv(seq)
        seq.status = Status.WAITING

    def _block_key(self, seq: _Seq, i: int, parent: bytes | None) -> bytes:
        """The prefix-cache key of block i of `seq` (its tokens and the images at their positions)."""
        lo, hi = i * self.config.page_size, (i + 1) * self.config.page_size
        return block_key(parent, seq.tokens[lo:hi], self._cache_version(),
                         vision.content_key(seq.images, lo, hi))

    def _register_blocks(self, seq: _Seq) -> None:
        """Registers each newly completed full block of `seq` in the prefix cache."""
        if not self.config.enable_prefix_cache:
            return
        ps = self.config.page_size
        while len(seq.block_keys) < seq.num_computed // ps:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else None
            key = self._block_key(seq, i, parent)
            self.pool.register(seq.pages[i], key)
            seq.block_keys.append(key)

    # ================================================================== scheduling

    def _admit(self) -> None:
        running = sum(s.status in (Status.PREFILLING, Status.RUNNING) for s in self._seqs.values())
        waiting = sorted((s for s in self._seqs.values() if s.status == Status.WAITING),
                         key=lambda s: (-s.priority, s.arrival))
        ps = self.config.page_size
        # Pages that admitted-but-unfinished prefills will still take: admission must not count them
        # as free, or one round admits far more than the pool holds.
        reserved = sum(-(-len(s.tokens) // ps) - len(s.pages)
                       for s in self._seqs.values() if s.status == Status.PREFILLING)
        for seq in waiting:
            if running >= self.config.max_running:
                return
            if seq.parent is not None and not seq.looked_up:
                leader = self._seqs.get(seq.parent)
                shared = (len(seq.tokens) - 1) // ps  # full prompt blocks, the last token excluded
                if leader is not None and leader.status not in (Status.FINISHED, Status.ABORTED) \
                        and leader.num_computed < shared * ps:
                    continue  # the leader has not prefilled the shared prompt yet
                if leader is not None and len(leader.pages) >= shared and leader.num_computed >= shared * ps:
                    seq.pages = [self.pool.fork(p) for p in leader.pages[:shared]]
                    seq.block_keys = list(leader.block_keys[:shared])
                    seq.num_computed = shared * ps
                    self._counters["prompt_tokens"] += len(seq.tokens)
                    self._counters["prompt_tokens_cached"] += shared * ps
                    seq.looked_up = True
                seq.parent = None
            if not seq.looked_up:
                missing = -(-len(seq.tokens) // ps) + 1 - len(seq.pages)
                if not can_admit(missing, self.pool.num_free, reserved, running):
                    return
                reserved += missing
                self._lookup_prefix(seq)
            seq.status = Status.PREFILLING
            running += 1

    def _lookup_prefix(self, seq: _Seq) -> None:
        """Takes cached blocks for the start of the uncomputed context (never its last token)."""
        ps = self.config.page_size
        start = seq.num_computed
        hits = 0
        if self.config.enable_prefix_cache and start % ps == 0:
            parent = seq.block_keys[-1] if seq.block_keys else None
            for i in range(start // ps, (len(seq.tokens) - 1) // ps):
                key = self._block_key(seq, i, parent)
                page = self.pool.lookup(key)
                if page is None:
                    break
                if len(seq.pages) > i:  # a partially filled page of ours stands there: replace it
                    self.pool.release(seq.pages[i])
                    seq.pages[i] = page
                else:
                    seq.pages.append(page)
                seq.block_keys.append(key)
                parent = key
                hits += 1
        seq.num_computed = start + hits * ps
        # Hit rate: of the context this prefill needs, how much was already cached (kept KV of a
        # paused sequence, or prefix-cache blocks).
        self._counters["prompt_tokens"] += len(seq.tokens)
        self._counters["prompt_tokens_cached"] += seq.num_computed
        seq.looked_up = True

    def _ensure_pages(self, seq: _Seq, num_tokens: int) -> bool:
        """Grows `seq` to hold `num_tokens` tokens of KV, preempting others if needed."""
        need = -(-num_tokens // self.config.page_size)
        while len(seq.pages) < need:
            try:
                seq.pages.append(self.pool.allocate())
            except OutOfPages:
                if not self._preempt_for(seq):
                    return False
        return True

    def _preempt_for(self, requester: _Seq) -> bool:
        # Idle holders of pages (paused, or resumed but not yet admitted) go first; a waiting
        # sequence that holds pages must be a candidate, or a full pool could deadlock.
        idle = (Status.PAUSED, Status.WAITING)
        candidates = [
            PreemptionCandidate(s.id, s.priority, s.arrival, s.status in idle, s.pinned, len(s.pages),
                                ready=s.status == Status.WAITING)
            for s in self._seqs.values()
            if s.pages and s.status in idle + (Status.PREFILLING, Status.RUNNING)]
        victim = choose_victim(candidates, requester.id, requester_priority=requester.priority,
                               requester_arrival=requester.arrival)
        if victim is None:
            return False
        v = self._seqs[victim]
        self._drop_kv(v)
        if v.status in (Status.PREFILLING, Status.RUNNING):
            v.status = Status.WAITING
        self._counters["preemptions"] += 1
        return True

    def _plan_prefill(self) -> list[tuple[_Seq, int]]:
        """Chunks (sequence, tokens) to prefill this step, within the policy's budget."""
        pending = sorted((s for s in self._seqs.values() if s.status == Status.PREFILLING),
                         key=lambda s: (-s.priority, s.arrival))
        decoding = sum(s.status == Status.RUNNING for s in self._seqs.values())
        budget = choose_prefill_budget(
            self.config.prefill_policy, PrefillSignals(len(pending), decoding),
            full_budget=self.config.prefill_budget,
            pressure_budget=self.config.prefill_pressure_budget)
        chunks = []
        for seq in pending:
            if budget <= 0 or len(chunks) >= self._prefill_row_buckets[-1]:
                break
            if seq.status != Status.PREFILLING:  # preempted while planning an earlier chunk
                continue
            n = min(len(seq.tokens) - seq.num_computed, self.config.prefill_chunk, budget)
            if not self._ensure_pages(seq, seq.num_computed + n):
                continue
            chunks.append((seq, n))
            budget -= n
        return [(s, n) for s, n in chunks if s.status == Status.PREFILLING]

    def _sampling_arrays(self, seqs: Sequence[_Seq], rows: int):
        pad = rows - len(seqs)
        temp = np.asarray([s.sampling.temperature for s in seqs] + [0.0] * pad, np.float32)
        top_k = np.asarray([s.sampling.top_k for s in seqs] + [0] * pad, np.int32)
        top_p = np.asarray([s.sampling.top_p for s in seqs] + [1.0] * pad, np.float32)
        seeds = np.asarray([s.sampling.seed for s in seqs] + [0] * pad, np.int32)
        index = np.asarray([s.num_sampled for s in seqs] + [0] * pad, np.int32)
        filtered = any(s.sampling.top_k > 0 or s.sampling.top_p < 1.0 for s in seqs)
        return temp, top_k, top_p, seeds, index, filtered

    def _page_table(self, seqs: Sequence[_Seq], rows: int, buckets=None) -> np.ndarray:
        width = bucket(max(len(s.pages) for s in seqs), buckets or self._page_buckets)
        table = np.zeros((rows, width), np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = s.pages
        return table

    def _run_prefill(self, chunks: list[tuple[_Seq, int]]) -> list[int]:
        """Runs the chunks in one call per chunk-length bucket, so a long chunk does not pad the short ones."""
        groups: dict[int, list] = {}
        for s, n in chunks:
            groups.setdefault(bucket(n, self._chunk_buckets), []).append((s, n))
        ended = []
        for width, group in sorted(groups.items()):
            ended += self._run_prefill_group(group, width)
        return ended

    def _packed_sizes(self, rows: int, width: int) -> list[int]:
        """The packed sizes of a prefill call in the [rows, width] view: the token buckets below rows * width, then
        rows * width itself (never more than the view's padding); only that without `ragged_prefill`."""
        padded = rows * width
        return [n for n in self._token_buckets if n < padded and self.config.ragged_prefill] + [padded]

    def _run_prefill_group(self, chunks: list[tuple[_Seq, int]], width: int) -> list[int]:
        """One ragged call: the chunks' tokens packed back to back (a bucket of their sum), the attention in the
        [rows, width] view (`PagedKV`)."""
        rows = bucket(len(chunks), self._prefill_row_buckets)
        seqs = [s for s, _ in chunks]
        sizes = [n for _, n in chunks]
        size = bucket(sum(sizes), self._packed_sizes(rows, width))
        # where each chunk starts in the packed tokens: back to back, or at its row of the padded block
        offsets = np.cumsum([0] + sizes[:-1]) if self.config.ragged_prefill else np.arange(len(chunks)) * width
        tokens, positions = np.zeros((1, size), np.int32), np.zeros((1, size), np.int32)
        unpack = np.full((rows, width), size, np.int32)
        pack, last = np.zeros(size, np.int32), np.zeros(rows, np.int32)
        starts, num_new = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for i, ((s, n), at) in enumerate(zip(chunks, offsets)):
            tokens[0, at:at + n] = s.tokens[s.num_computed:s.num_computed + n]
            positions[0, at:at + n] = np.arange(s.num_computed, s.num_computed + n)
            unpack[i, :n] = np.arange(at, at + n)
            pack[at:at + n] = i * width + np.arange(n)
            starts[i], num_new[i], last[i] = s.num_computed, n, at + n - 1
        temp, top_k, top_p, seeds, index, filtered = self._sampling_arrays(seqs, rows)
        tok, lps, lpm = self.runner.prefill(tokens, positions, unpack, pack, last,
                                            self._page_table(seqs, rows, self._prefill_page_buckets), starts,
                                            num_new, temp, top_k, top_p, seeds, index, filtered=filtered,
                                            **self._image_inputs(chunks, offsets, size))
        self._counters["prefill_calls"] += 1
        self._counters["prefill_slots"] = self._counters.get("prefill_slots", 0) + size  # padding included
        ended = []
        now = time.perf_counter()
        for i, (s, n) in enumerate(chunks):
            s.num_computed += n
            self._counters["prefill_tokens_computed"] += n
            self._register_blocks(s)
            if s.num_computed == len(s.tokens):  # context complete: its last logits give a token
                s.status = Status.RUNNING
                if self._accept(s, int(tok[i]), float(lps[i]), float(lpm[i]), now):
                    ended.append(s.id)
        return ended

    def _image_inputs(self, chunks: list[tuple[_Seq, int]], offsets, size: int) -> dict:
        """A vision model's prefill inputs for `chunks`, packed as their tokens ([1, size], each chunk from its
        offset); {} for a text model."""
        if not self.model_cfg.is_vision:
            return {}
        patches = np.zeros((1, size, self.model_cfg.image_patch_dim), np.float32)
        patch_index = np.full((1, size), -1, np.int32)
        for (s, n), at in zip(chunks, offsets):
            patches[0, at:at + n], patch_index[0, at:at + n] = vision.dense_inputs(
                s.images, s.num_computed, s.num_computed + n, self.model_cfg.image_patch_dim)
        return dict(patches=patches, patch_index=patch_index)

    def _accept(self, s: _Seq, token: int, lp_sample: float, lp_model: float, now: float) -> bool:
        """Appends one sampled token; ends the turn on a stop id or the budget. True if it ended."""
        self._append(s, [token], generated=True, logp_sample=[lp_sample], logp_model=[lp_model])
        s.turn_generated += 1
        s.num_sampled += 1
        if s.first_token_time is None:
            s.first_token_time = now
        reason = None
        if token in s.sampling.stop_ids:
            reason = "stop"
        elif s.turn_generated >= s.sampling.max_new_tokens or len(s.tokens) >= self.config.max_seq_len:
            reason = "length"
        if reason is None:
            return False
        self._close_turn(s, reason, now)
        return True

    def _close_turn(self, s: _Seq, reason: str, now: float) -> None:
        """The turn ended: paused with its KV (keep_kv) or finished; its full blocks cached either way."""
        s.finish_reason = reason
        s.finish_time = now
        self._register_blocks(s)
        if s.keep_kv:
            s.status = Status.PAUSED
        else:
            self._drop_kv(s)
            s.status = Status.FINISHED

    def _run_decode(self, steps: int) -> list[int]:
        running = sorted((s for s in self._seqs.values() if s.status == Status.RUNNING),
                         key=lambda s: (-s.priority, s.arrival))
        if not running:
            return []
        t0 = time.perf_counter()
        spec = self._speculate(min(len(running), self.config.max_running), steps)  # WAR: speculation.py
        horizon = 1 + self.config.spec_tokens if spec else steps
        batch = []
        for s in running:
            if s.status != Status.RUNNING:  # preempted for an earlier row of this batch
                continue
            grow = min(horizon, s.sampling.max_new_tokens - s.turn_generated,
                       self.config.max_seq_len - len(s.tokens))
            if self._ensure_pages(s, len(s.tokens) - 1 + grow):
                batch.append(s)
            elif self._ensure_pages(s, len(s.tokens)):
                batch.append(s)
                steps, spec = 1, False
            else:  # cannot even take one more token: give way and recompute later
                self._drop_kv(s)
                s.status = Status.WAITING
                self._counters["preemptions"] += 1
        batch = [s for s in batch if s.status == Status.RUNNING][: self.config.max_running]
        if not batch:
            return []
        if spec:
            return self._run_verify(batch, t0)
        rows = bucket(len(batch), self._row_buckets)
        pad = rows - len(batch)
        tokens = np.asarray([s.tokens[-1] for s in batch] + [0] * pad, np.int32)
        starts = np.asarray([len(s.tokens) - 1 for s in batch] + [0] * pad, np.int32)
        live = np.asarray([True] * len(batch) + [False] * pad)
        remaining = np.asarray([min(s.sampling.max_new_tokens - s.turn_generated,
                                    self.config.max_seq_len - len(s.tokens)) for s in batch]
                               + [0] * pad, np.int32)
        stops = np.asarray(stop_matrix([s.sampling.stop_ids for s in batch] + [()] * pad,
                                       self.config.max_stop_ids), np.int32)
        temp, top_k, top_p, seeds, index, filtered = self._sampling_arrays(batch, rows)
        max_steps = self.config.decode_steps
        tok, lps, lpm, ok = self.runner.decode(
            tokens, self._page_table(batch, rows), starts, live, remaining, stops, temp, top_k,
            top_p, seeds, index, min(steps, max_steps), max_steps=max_steps, filtered=filtered)
        compiled = self.runner.compiled
        self._counters["decode_calls"] += 1
        # token slots the call computed, padded rows and the steps past a row's end included
        self._counters["decode_slots"] = self._counters.get("decode_slots", 0) + rows * min(steps, max_steps)
        now = time.perf_counter()
        ended = [s.id for i, s in enumerate(batch)
                 if self._emit(s, tok[ok[:, i], i], lps[ok[:, i], i], lpm[ok[:, i], i], now)]
        if not compiled:  # seconds per step, host work included (WAR's switch compares it to speculation)
            n = min(steps, max_steps)
            self.spec_switch.record_decode(len(batch), n > 1, (time.perf_counter() - t0) / n)
        return ended

    def _emit(self, s: _Seq, tokens, lps, lpm, now: float) -> bool:
        """Appends a decode call's tokens for `s` (each fed token's KV is now cached) until its turn ends;
        returns the pages allocated ahead and not used. True when the turn ended."""
        ended = False
        for t, a, b in zip(tokens, lps, lpm):
            s.num_computed = len(s.tokens)  # the token fed at this step is now cached
            self._counters["decode_tokens"] += 1
            if self._accept(s, int(t), float(a), float(b), now):
                ended = True
                break
        if s.status == Status.RUNNING:
            self._trim_pages(s)
        self._register_blocks(s)
        return ended

    def _trim_pages(self, s: _Seq) -> None:
        """Returns pages allocated ahead for decode steps that did not happen."""
        need = -(-len(s.tokens) // self.config.page_size)
        while len(s.pages) > need:
            self.pool.release(s.pages.pop())
