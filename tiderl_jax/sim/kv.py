"""The KV / prefix-cache model of `SimBackend`'s replicas (`KVModel`: pages, CTB footprints and task
admission, eviction, prefix-cache hits, what an admission prefills and its seconds, the engine's program
loads, the KV hit rate), and the state it shares with the event core (`replicas.py`): `_Seq` (a task on
the rollout side), `_Replica` (a continuous-batching server) and `_Waiter` (what a GRPO group awaits).
Compiled by Cython with the types in kv.pxd, with replicas.py, when built (`tiderl_jax.sim`); run as it
is, it is the reference.

What is modelled (parameters in `config.SimConfig`):

- **Admission** (at a replica's event, before its decode steps: replicas.py): the batched prefill of the
  sequences admitted (new, resumed) since the last event is `costs.prefill_time` summed over sequences with
  the weights read once (`_prefill_time`; the event's formula is in replicas.py).
  KV capacity in pages (`costs.kv_capacity_pages`, or `kv_pages`); a turn is admitted only when the
  pages of its context plus the tokens it will write fit (ours: the simulator knows the turn's
  length, so nothing is preempted mid-turn), evicting cached KV (LRU) first; at most `max_batch`
  sequences run at once.
- **KV modes** (as the real rollout): `ctb` (mode tiderl): a task is admitted while its footprint
  estimate fits the replica's budget (`policies.ctb.estimate_footprint` with the margin of
  `expected_remaining_turns`, `admit_tasks`: first come, first served); its KV stays pinned across
  tool calls, so a resume prefills only the observation; when a turn does not fit, waiting tasks'
  KV is evicted (`ctb.choose_evictions`) into the prefix cache. `request` (sync / async): after each
  turn the sequence's KV becomes evictable prefix cache (LRU, full pages); the next turn prefills
  the whole context minus what is still cached. The engine keys prefix blocks by policy version and
  chains each block's key to its parent's, and a lookup walks from the first block: an entry hits only
  under the version its chain began in, the version of the sequence's last prefill from its first block
  (`_Seq.kv_version`; a turn that runs across a weight update keeps its KV but its next lookup misses);
  pinned KV survives weight updates (`EngineConfig.on_update="continue"`). A GRPO group's prompt hits
  when another sample of the group already holds it on the same replica (under the current version:
  a sample prefilled again writes it anew), as does the shared system prefix. KV hit rate = cached
  prompt tokens / prompt tokens over every prefill admission (the engine's counter).
- **Measured costs** (`SimConfig.measured`) with `engine_steps`, the real engine's admission rules (each an
  `Engine` behaviour; its step rules are in replicas.py): an engine call prefills at most `prefill_chunk`
  tokens of a sequence and `prefill_budget` in all (a longer prefill goes on in the next calls, the
  sequence decoding from the call of its last chunk), in one call per chunk-length bucket
  (`prefill_chunk`); a first turn's prompt hits
  the prefix cache only for blocks computed by an earlier call (a GRPO group's samples admitted together
  all compute it; `shared_prefix_tokens`: the system prompt every task shares); a call whose shape bucket
  the process has not run yet loads its program (`MeasuredCosts.program_s`, `max_seq_len`; `programs`:
  what the simulated process has run, shared by the backends of one process).
"""

from __future__ import annotations

import asyncio
import collections
import heapq

from tiderl_jax.policies import ctb
from tiderl_jax.sim import workloads


_INF = float("inf")


class _Waiter:
    """What `generate_group` awaits: its future resolves when `left` reaches 0 (`_finish`)."""
    __slots__ = ("future", "left")

    def __init__(self, future: asyncio.Future, left: int):
        self.future, self.left = future, left


class _Seq:
    """One task (a GRPO sample) on the rollout side."""
    __slots__ = ("gid", "sample", "shape", "gen", "obs", "latency", "prompt", "turn", "left", "ctx", "written",
                 "versions", "replica", "future", "pinned", "kv_pages", "kv_version", "footprint", "tokens_added",
                 "wait_started", "new_tokens", "admitted", "start", "end", "ctx0", "run", "pf_left", "pf_done", "born",
                 "cls")

    def __init__(self, gid: int, sample: int, shape: workloads.TaskSample, future: _Waiter | None):
        self.gid, self.sample, self.shape, self.future = gid, sample, shape, future
        # the shape's fields the event core reads at every turn
        self.gen, self.obs, self.latency, self.prompt = (shape.gen_tokens, shape.obs_tokens, shape.env_latency_s,
                                                         shape.prompt_tokens)
        self.turn = 0
        self.left = shape.gen_tokens[0]  # tokens still to write this turn
        self.ctx = shape.prompt_tokens  # tokens of context (prompt + written + observations)
        self.written = 0
        self.versions: dict[int, int] = {}
        self.replica: _Replica | None = None
        self.pinned = False  # CTB: KV held while the environment runs
        self.kv_pages = 0  # pages it holds (running reservation or pinned)
        self.kv_version = 0  # the version its KV's prefix-cache chain is keyed by (its last prefill from block 0)
        self.footprint = 0  # CTB admission estimate (tokens), 0 before admission
        self.tokens_added = 0
        self.wait_started = 0.0
        self.new_tokens = 0  # prefill work of its next event
        self.admitted = False  # CTB task admission done
        # while running (lazy: `left`, `ctx`, `written`, `versions` are brought up to date when the
        # turn ends or the replica goes away): the replica's decode-step count when it started this
        # turn, that count when the turn ends, its context then, and its admission number (-1: not running)
        self.start = self.end = self.ctx0 = 0
        self.run = -1
        # while prefilling over several events (SimConfig.prefill_budget): tokens still to prefill, and its
        # context's tokens computed (cached or prefilled) so far
        self.pf_left = self.pf_done = 0
        self.cls = shape.cls  # its workload class (the router's)
        self.born = -1.0  # when it was first offered (SimConfig.router: its session latency starts)


class _Replica:
    """A continuous-batching server on `tp` devices (state; `SimBackend._wake` runs it on the
    backend's event heap).

    Running sequences are kept lazily, so an event costs O(log B) plus the turns it ends, not O(B):
    every running sequence advances by the event's K tokens, so the replica counts decode `steps` and
    a sequence's turn ends at step `start + left`; `ends` (min-heap) yields the turns an event ends,
    `maxend` the step the longest turn ends at, for K (turns end in step order, so it only grows while any
    sequence runs: the one that ends last is the last to leave), and the context sum
    is `ctx_base + len(running) * steps`. `vlog` lists (step, version) where the weights changed, so
    a turn's tokens per version are counted when it ends.

    Events run in spans (`SimBackend._walk`): a span is the run of decode chunks (events) between two
    boundaries where the replica's batch can change; only its last boundary is on the event heap
    (`wake_at`). Environment returns wait in `arrivals` (a per-replica heap) and join the queue at the
    first chunk boundary after they arrive, as if queued at once."""

    __slots__ = ("rid", "devices", "capacity", "version", "pending", "queue", "running", "steps", "ends",
                 "maxend", "ctx_base", "vlog", "used", "cache", "cache_pages", "pinned", "footprints", "live",
                 "prompts", "alive", "borrowed", "busy", "retry", "arrivals", "wake_at", "span_start", "span_prefill",
                 "span_steps", "span_batch", "span_ctx_base", "span_maxend", "span_first_end", "w_step", "w_start",
                 "w_prefill", "w_first", "w_step_s", "w_prev", "w_chunks", "w_dur", "one_step", "events", "prefix_at",
                 "programs", "prefilling", "r_tokens", "r_prompt", "r_cached", "r_seen_prompt", "r_seen_cached",
                 "r_busy")

    def __init__(self, rid: int, devices: tuple, capacity: int):
        self.rid, self.devices, self.capacity = rid, devices, capacity  # capacity in pages
        self.version = 0
        self.pending: collections.deque[_Seq] = collections.deque()  # CTB: new tasks awaiting task admission
        self.queue: collections.deque[_Seq] = collections.deque()  # the engine's queue: turns to start, FIFO
        self.running: dict[_Seq, None] = {}  # insertion order = admission order
        # admitted turns whose prefill goes on in the next events (SimConfig.prefill_budget), in admission order
        self.prefilling: collections.deque[_Seq] = collections.deque()
        self.steps = 0  # decode steps done
        self.ends: list = []  # (step its turn ends at, admission number, seq)
        self.maxend = 0  # the latest step a running sequence's turn ends at
        self.ctx_base = 0  # sum over running of (context at admission - step at admission)
        self.vlog: list[tuple[int, int]] = [(0, 0)]  # (decode step, version from that step on)
        self.used = 0  # pages held by running (reserved to the turn's end) and pinned sequences
        self.cache: collections.OrderedDict = collections.OrderedDict()  # seq -> (pages, tokens, version)
        self.cache_pages = 0
        self.pinned: dict[_Seq, None] = {}  # CTB: waiting tasks holding KV (insertion order)
        self.footprints = 0  # CTB: admitted tasks' footprint estimates (tokens)
        self.live = 0  # tasks placed here and not finished
        self.prompts: dict[int, list] = {}  # gid -> [version written, samples here holding it, event]
        self.events = 0  # events that admitted (SimConfig.engine_steps: what a block computed by then is)
        self.prefix_at = (-1, 0)  # (version, event) of the first prompt prefilled under that version
        self.programs: set = set()  # shape buckets this replica's engine has run (SimConfig.max_seq_len)
        self.alive = True
        self.borrowed = False  # BiDiRL: serving on borrowed train devices
        self.busy = False  # a span of events in flight
        self.retry = False  # an admission that failed changed the KV: the next event boundary tries again
        self.arrivals: list = []  # (time, order, seq): environment returns and placements not yet queued
        self.wake_at = _INF  # when its next heap entry runs (`_wake`); entries at other times are stale
        # the span in flight: its start, prefill seconds, first step, batch, ctx_base, longest end, first turn end
        self.span_start = self.span_prefill = 0.0
        self.span_steps = self.span_batch = self.span_ctx_base = self.span_maxend = self.span_first_end = 0
        # its last event (the one `wake_at` ends): the decode step count then; that event's start, prefill
        # seconds, first step and decode step seconds; its start time, events and busy seconds so far
        self.w_step = 0
        self.w_start = self.w_prefill = self.w_step_s = 0.0
        self.w_first = 0
        self.w_prev = 0.0
        self.w_chunks = 0
        self.w_dur = 0.0
        self.one_step = False  # SimConfig.engine_steps: the span's event prefilled or left a turn waiting
        # with SimConfig.router (what its views read): tokens prefilled and decoded, the busy seconds they took,
        # prompt tokens admitted and those found cached, and the last two at the router's last look
        self.r_tokens = self.r_prompt = self.r_cached = self.r_seen_prompt = self.r_seen_cached = 0
        self.r_busy = 0.0


class KVModel:
    """The KV / prefix-cache model of the replicas (see the module docstring): the base of
    `replicas.ReplicaCore`, so of `SimBackend`, whose `__init__` sets its state."""

    # ---------------------------------------------------------------- admission

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def _footprint(self, seq: _Seq) -> int:
        turn = seq.turn
        margin = self._remaining_turns.get(turn)  # max(1, expected remaining turns), per turns done
        if margin is None:
            margin = self._remaining_turns[turn] = max(
                1.0, ctb.expected_remaining_turns(turn, self._window, self.workload.max_turns))
        return ctb.estimate_footprint(seq.ctx, turn, seq.tokens_added, initial_growth=self.cfg.initial_growth,
                                      margin_turns=margin)

    def _free(self, r: _Replica) -> int:
        return r.capacity - r.used - r.cache_pages

    def _evict_cache(self, r: _Replica, need, keep: _Seq | None) -> None:
        """LRU: drops cached KV until `need` pages are free (never `keep`'s own entry)."""
        s: _Seq
        for s in list(r.cache):
            if self._free(r) >= need:
                return
            if s is keep:
                continue
            pages = r.cache.pop(s)[0]
            r.cache_pages -= pages
            self.counters["cache_evictions"] += 1

    def _evict_pinned(self, r: _Replica, need: int, keep: _Seq | None = None) -> None:
        """CTB: waiting tasks' KV dropped (into the prefix cache) by `ctb.choose_evictions`; never
        `keep`'s (the task being admitted: its pinned pages are part of what it needs)."""
        shortfall = need - self._free(r)
        if shortfall <= 0 or not r.pinned:
            return
        now = self.loop.time()
        by_id = {}
        signals = []
        for i, s in enumerate(r.pinned):
            if s is keep:
                continue
            by_id[i] = s
            signals.append(ctb.TaskKVSignals(
                task_id=i, is_eval=False, group_completion=0.0, is_active=False, context_len=s.kv_pages * self.ps,
                expected_wait_s=max(0.0, self._mean_latency - (now - s.wait_started))))
        for i in ctb.choose_evictions(signals, shortfall * self.ps, readiness_aware=self.cfg.readiness_aware):
            s = by_id[i]
            del r.pinned[s]
            s.pinned = False
            r.used -= s.kv_pages
            full = (s.ctx // self.ps)
            r.cache[s] = (s.kv_pages, full * self.ps, s.kv_version)
            r.cache_pages += s.kv_pages
            s.kv_pages = 0
            self.counters["ctb_evictions"] += 1

    def _admit(self, r: _Replica) -> float:
        """Starts the turns of the queue's sequences that fit now (FIFO, no overtaking); returns the seconds
        of their prefill."""
        s: _Seq
        ctb_mode = self._ctb
        budget = r.capacity * self.ps
        while r.pending:  # CTB task-level admission on the footprint estimate (first come, first served)
            s = r.pending[0]
            f = self._footprint(s)
            if not ctb.admit_tasks([(0, f)], budget_tokens=budget, used_tokens=r.footprints):
                break
            r.pending.popleft()
            s.footprint, s.admitted = f, True
            r.footprints += f
            r.queue.append(s)
        ps = self.ps
        queue, running, max_batch = r.queue, r.running, self._max_batch
        prompt_tokens = cached_tokens = prefill_tokens = 0
        pairs = 0.0
        chunk_buckets = self._chunk_buckets
        calls: dict[int, list] = {}  # chunk-length bucket -> [rows, most pages]: one prefill call each
        # `Engine._plan_prefill` (engine_steps with prefill_chunk): per event at most `chunk` tokens of a sequence,
        # `budget` tokens in all, `row_cap` sequences; prefills admitted by earlier events go first
        chunk = chunk_buckets[-1] if chunk_buckets else 0
        budget = self._prefill_budget
        row_cap = self._prefill_row_cap
        rows = 0
        work = 0  # tokens this event prefills
        n: int
        prefilling = r.prefilling
        if prefilling:
            for s in prefilling:
                if budget <= 0 or rows >= row_cap:
                    break
                n = min(s.pf_left, chunk, budget)
                call = calls.setdefault(_bucket(n, chunk_buckets), [0, 0])
                call[0] += 1
                call[1] = max(call[1], -(-(s.pf_done + n) // ps))
                pairs += n * s.pf_done + n * (n + 1) / 2
                s.pf_done += n
                s.pf_left -= n
                budget -= n
                rows += 1
                work += n
            if any(q.pf_left == 0 for q in prefilling):
                done = [q for q in prefilling if q.pf_left == 0]
                r.prefilling = prefilling = collections.deque(q for q in prefilling if q.pf_left)
                for s in done:
                    self._start(r, s)
        while queue and len(running) + len(prefilling) < max_batch:
            s = queue[0]
            need = -(-(s.ctx + s.left) // ps) - s.kv_pages  # pages to the end of the turn
            entry = r.cache.get(s)
            own = entry[0] if entry is not None else 0  # its own cached pages become its KV
            if r.capacity - r.used - r.cache_pages + own < need:
                c = self.counters
                evictions = c["cache_evictions"] + c["ctb_evictions"]
                self._evict_cache(r, need - own, keep=s)
                if ctb_mode and self._free(r) + own < need:
                    self._evict_pinned(r, need - own, keep=s)
                    self._evict_cache(r, need - own, keep=s)
                if self._free(r) + own < need and (r.used > 0 or r.running):
                    # what it evicted may let the next try pass: the next event boundary tries again
                    r.retry = c["cache_evictions"] + c["ctb_evictions"] != evictions
                    break
            queue.popleft()
            # what is cached of the context: pinned KV, a prefix-cache entry of this version, the group prompt
            if s.pinned:
                cached = s.ctx - s.new_tokens  # all but the observation
                del r.pinned[s]
                s.pinned = False
            else:
                cached = 0
                entry = r.cache.pop(s, None)
                if entry is not None:
                    r.cache_pages -= entry[0]
                    if entry[2] == r.version:
                        cached = entry[1]
                first = s.turn == 0 and s.written == 0
                if first or not cached:  # its prompt: blocks of this version another sample computed
                    p = r.prompts.get(s.gid)
                    if self._engine_steps:  # blocks computed in an earlier event only (`SimConfig.engine_steps`)
                        event = r.events
                        if p is not None and p[0] == r.version and p[1] > 0 and p[2] < event:
                            cached = max(cached, (s.prompt - 1) // ps * ps)
                        elif r.prefix_at[0] == r.version and r.prefix_at[1] < event:
                            cached = max(cached, min(self._shared_prefix, s.prompt - 1)
                                         // ps * ps)
                        if r.prefix_at[0] != r.version:
                            r.prefix_at = (r.version, event)
                    elif p is not None and p[0] == r.version and p[1] > 0:
                        cached = max(cached, (s.prompt - 1) // ps * ps)
                    if p is None or p[0] != r.version:  # (a re-prefill writes the group's prompt under this version)
                        r.prompts[s.gid] = p = [r.version, 0 if first else 1, r.events]
                    if first:
                        p[1] += 1
                s.kv_version = r.version  # a hit was of this version; a miss prefills the chain anew under it
            ctx = s.ctx
            new = ctx - cached
            s.new_tokens = 0  # prefilled by this event
            prompt_tokens += ctx
            cached_tokens += cached
            prefill_tokens += new
            r.used += need
            s.kv_pages += need
            if chunk_buckets:  # its first chunk, if the event has room for it
                if budget > 0 and rows < row_cap:
                    n = min(new, chunk, budget)
                    call = calls.setdefault(_bucket(n, chunk_buckets), [0, 0])
                    call[0] += 1
                    call[1] = max(call[1], -(-(cached + n) // ps))
                    budget -= n
                    rows += 1
                else:
                    n = 0
                pairs += n * cached + n * (n + 1) / 2
                work += n
                if n < new:  # the rest in the next events
                    s.pf_left, s.pf_done = new - n, cached + n
                    prefilling.append(s)
                    continue
            else:
                pairs += new * cached + new * (new + 1) / 2
                work += new
            self._start(r, s)
        r.events += 1
        if not prompt_tokens and not calls:
            return 0.0
        self._prompt_tokens += prompt_tokens
        self._prompt_tokens_cached += cached_tokens
        if self._routing:
            r.r_prompt += prompt_tokens
            r.r_cached += cached_tokens
            r.r_tokens += work
        self._prefill_tokens += prefill_tokens
        seconds = self._prefill_time(work, cached_tokens, pairs, len(calls) or 1)
        if self._program_s:  # programs this engine has not run yet (SimConfig.max_seq_len)
            for width, (rows, pages) in calls.items():
                key = ("prefill", _bucket(rows, self._prefill_rows), width, _bucket(pages, self._prefill_pages))
                seconds += self._program(r, key)
        return seconds

    def _start(self, r: _Replica, s: _Seq) -> None:
        """`s`'s turn runs from this event's decode on (its prefill done)."""
        steps = r.steps
        end = steps + s.left
        s.start, s.end, s.ctx0 = steps, end, s.ctx
        s.run = n = self._admissions
        self._admissions = n + 1
        r.ctx_base += s.ctx - steps
        heapq.heappush(r.ends, (end, n, s))
        if end > r.maxend or not r.running:
            r.maxend = end
        r.running[s] = None

    # ---------------------------------------------------------------- prefill costs

    def _program(self, r: _Replica, key: tuple) -> float:
        """Seconds to get the device program of shape bucket `key` on `r` (SimConfig.max_seq_len):
        `program_s` the first time (in this process: `programs`, or on this replica), else 0."""
        seen, key = (r.programs, key) if self.programs is None else (self.programs, (r.devices, key))
        if key in seen:
            return 0.0
        seen.add(key)
        self._compiled_s += self._program_s
        return self._program_s

    def _prefill_time(self, n, c, pairs: float, calls=1) -> float:
        """One batched prefill of `n` new tokens over `c` cached ones, `pairs` causal attention pairs in all
        (sum over sequences of new * cached + new * (new + 1) / 2); measured costs: in `calls` calls."""
        if self.measured is not None:
            m = self.measured
            return m.prefill_fixed_s * calls + m.prefill_per_token_s * n + m.prefill_per_pair_s * pairs if n else 0.0
        if n == 0:
            return 0.0
        flops = 2.0 * self._matmul_params * n + self._attn_per_pair * pairs
        bytes_moved = self._param_bytes + self._kv_bytes * (c + n)
        return max(flops / self._prefill_rate, bytes_moved / self._bytes_rate)

    def kv_hit_rate(self) -> float:
        return self._prompt_tokens_cached / max(1, self._prompt_tokens)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    """`engine.runner.bucket`: the smallest bucket that holds n (the largest if none does)."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]
