"""The replica event core of `SimBackend` (`ReplicaCore`, its compiled base; the KV model it calls is
`kv.KVModel`, its base): the rollout side of the controller's `Backend` (`generate_group`, `publish`,
`stop`), the replica set (`_rebuild`, `_rebalance`: what moves and borrows change, switches.py), task
placement, the event heap and its driver, spans of decode events, turn ends, and busy accounting.
Compiled by Cython with the types in replicas.pxd, with kv.py, when built (`tiderl_jax.sim`); run as it
is, it is the reference.

**The event core.** Train, reference scoring, weight sync and moves are `asyncio.sleep`s of their
cost. The rollout side runs on one heap of timed entries inside the backend (this module and kv.py,
compiled when built): one loop timer fires the earliest, and the driver (`_drive`) keeps popping entries
and advancing the virtual clock itself as long as nothing else on the loop could happen first
(`VirtualTimeLoop.quiet_until`: no ready callback, no earlier timer). A replica has one entry, at its
next *boundary* where its batch can change (`_wake`): between two, its decode events (chunks) are
timed in one loop (`_walk`, a *span*), event after event with the same sums as one heap entry per
event (tests/test_sim_backend.py checks a run against that). A span ends with the event in which a
turn ends, or the first that ends after something arrives (an environment return, kept on the
replica's own `arrivals` heap, or a new task); a new version, CTB's refreshed estimate, or an
admission that evicted without succeeding end it at the next boundary (`_cut`), because the old
core tried admission at every event. The only asyncio object per GRPO group is the future
`generate_group` awaits (every sample's whole multi-turn trajectory runs in the heap); when the
group's last sample ends its future wakes the controller and the driver yields back to the loop at
that virtual instant. Same-instant order: heap
entries in the order they were pushed; an idle replica that gets work starts once the driver reaches
that instant (all enqueues of the instant made before then join its first event).

What is modelled (parameters in `config.SimConfig`):

- **Rollout**: `tp`-device replicas on the rollout devices, each a continuous-batching server (its
  events on the heap). Per event: prefill of the sequences admitted (new, resumed) since the last event, then
  K decode steps of every running sequence, K = min(`decode_chunk`, most tokens any of them still
  has to write this turn) (the engine's multi-step decode: a sequence that ends early rides along
  to the end of the chunk but its turn ends at its own step):

      prefill = roofline(2 * matmul_params * sum(n_i) + attention_flops(sum causal_pairs(n_i, c_i)),
                         param_bytes + kv_bytes_per_token * sum(c_i + n_i))      (n new, c cached)
      decode  = K * decode_step_time(B, sum(context_i) + B * (K - 1) / 2)        (B running)
      event   = prefill + decode                         (then every sequence advances K tokens)

  the batched prefill is `costs.prefill_time` summed over sequences with the weights read once. What is
  admitted, and what its prefill finds cached: the KV model (kv.py).
- **Placement** (`SimConfig.router`): by default ("sticky") a task stays on its replica; a new task goes
  to the replica with the fewest live tasks (ties: lowest id). With a router policy (any of
  `policies.routing.POLICIES`, router.py), every placement goes through `routing.route`: a new task, and
  each continuation once its tool call returns (`_env_return`), is offered to the router at a routing call
  at that instant (`_route_soon`, one heap entry per instant), with the views the rollout service builds
  (serving/service.py): held requests wait and are offered again at the next call, which comes with the next
  event that can change the answer (a turn ends, a task ends, the replica set changes). A continuation placed
  off the replica holding its KV recomputes its context where it lands (`_assign`); finished tasks are
  reported as ended sessions (MISA-T). A replica removed by a move loses its KV; its tasks continue on
  others (their next prefill recomputes the whole context); with a router, replicas added or removed are
  just the live list it sees (no `_rebalance`).
- **Weight sync** (`weight_sync_time` + `sync_fixed_s`): replicas swap in the new version after it;
  decode events already in flight finish on the old weights (token versions recorded per event).
- **WAR speculative decoding** (`war_speculation`, modes `+war` of launch/simulate.py; roofline
  costs): per event, a verify step of `spec_draft_tokens` + 1 tokens per sequence (its roofline over
  the same context) emitting `spec_accepted_tokens` replaces the decode step when
  `war.use_speculation` says it pays (batch <= 16 and less time per emitted token). The drafter's own
  time is taken as nil (WAR's is model-free: suffix trees on the host).
- **Measured costs** (`SimConfig.measured`, `costs.MeasuredCosts`; benchmarks/sim_validation.py): per-op
  times measured on a host replace the roofline (no scaling with device counts: fake devices that share
  a host's cores do not add speed), `tp=0` runs one replica on all rollout devices (one engine, as the
  real backend); while train / ref jobs share the cores (trainer_costs.py), in-flight replica events are
  re-timed when the first job starts and the last one ends (`_rescale_rollout`). With them, the real
  engine's own rules replace the roofline replica's where they differ (`engine_steps`, each an `Engine`
  behaviour): an event is one engine call, which decodes 1 step when it prefills or leaves a turn waiting
  and a whole `decode_chunk` otherwise (ended rows ride along), and hands its ended turns to the rollout
  loop when it returns (its prefill rules and program loads: kv.py); every call pays the rollout
  loop's measured host time (`MeasuredCosts.call_overhead_s`).

Busy time (waiting, docs/glossary.md): with `attach(metrics)`, each replica event adds
`seconds * tp` busy device-seconds to the rollout lane (replicas idle while others work count as
waiting), wall busy seconds add `seconds * tp / rollout devices` (the mean replica's busy time, what
ERS scales with device count), and the timeline gets one span while any replica is busy. In sync
mode (shared lanes) the rollout lane is busy while any replica is (the metric's span definition),
and the device-seconds of replicas idle inside that span (a batch's tail) go to
`RunMetrics.idle_in_spans`, rollout waiting: each device is counted once either way.
"""

from __future__ import annotations

import asyncio
import heapq

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.policies import war
from tiderl_jax.sim.config import SimTrajectory
from tiderl_jax.sim.kv import _INF, KVModel, _bucket, _Replica, _Seq, _Waiter


class ReplicaCore(KVModel):
    """The replicas of `SimBackend` on its event heap (see the module docstring): the base of `SimBackend`,
    whose `__init__` sets its state."""

    # ---------------------------------------------------------------- the interface: the rollout side

    async def stop(self) -> None:
        now = self.loop._now
        for r in self.replicas.values():  # the events of spans in flight that ended by now count
            if r.busy:
                end = self._walk(r, now)
                self._events += r.w_chunks - 1
                if self._busy_lane:
                    self._add_busy(r, r.w_dur - (end - r.w_prev))
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        self._heap.clear()
        if self._routing:
            self.router.armed = False
        self._started = False

    async def generate(self, task, group, sample, expected_group_size) -> Trajectory:
        return (await self.generate_group(task, group, [sample], expected_group_size))[0]

    async def generate_group(self, task, group, samples, expected_group_size) -> list[Trajectory]:
        """Samples `samples` of one GRPO group, placed in order; returns when the last one ends (one
        asyncio future per group: the controller acts on a group only once it is complete)."""
        waiter = _Waiter(self.loop.create_future(), len(samples))
        seqs = [_Seq(group, i, self._shape(group, i, expected_group_size), waiter) for i in samples]
        for seq in seqs:
            self._place(seq)
        await waiter.future
        return [SimTrajectory(task.task_id, task.kind, group, info={"sample": seq.sample}, end_reason="answered",
                              model_tokens=sum(seq.shape.gen_tokens), context_tokens=seq.shape.context_tokens,
                              version_tokens=seq.versions) for seq in seqs]

    async def publish(self, version: int) -> bool:
        await asyncio.sleep(self._sync_s)
        self.version = version
        now = self.loop._now
        for r in self.replicas.values():
            r.version = version
            if r.busy:  # the events after the one in flight run the new weights
                self._cut(r, now)
        return True

    # ---------------------------------------------------------------- replicas

    def _rebuild(self) -> None:
        """Replicas over the rollout devices now: kept where their devices stay, new ones empty,
        removed ones' tasks placed elsewhere without their KV."""
        devs = self._devices("rollout")
        self._rollout_devices = len(devs)
        tp = self.cfg.tp or len(devs)
        self._replica_devices = tp
        wanted = [tuple(devs[i:i + tp]) for i in range(0, len(devs) - tp + 1, tp)]
        wanted = [k for k in wanted if k not in self._lent] + list(self._borrowed)  # BiDiRL
        orphans: list[_Seq] = []
        for key in [k for k in self.replicas if k not in set(wanted)]:
            r = self.replicas.pop(key)
            r.alive = False  # its event on the heap is skipped
            if r.busy:  # the events of its span that ended count; the one in flight is cut short (lost)
                end = self._walk(r, self.loop._now)
                r.steps = r.w_first
                self._events += r.w_chunks - 1
                self._busy_end(r, r.w_dur - (end - r.w_prev))
            for s in list(r.running):
                self._retire(r, s)  # what earlier events wrote
                orphans.append(s)
            now = self.loop._now
            self._arrived(r, now)  # returned: in the queue
            for at, order, s in r.arrivals:  # still in their environment: placed when they return
                heapq.heappush(self._heap, (at, order, s))
                if not self._driving:
                    self._arm(at)
            r.arrivals = []
            orphans.extend(r.prefilling)  # (their prefill so far lost with the KV)
            orphans.extend(r.queue)
            orphans.extend(r.pending)
            for s in list(r.pinned) + list(r.cache):
                s.pinned = False
            for s in orphans + list(r.queue) + list(r.pinned):
                s.kv_pages = 0
        for key in wanted:
            if key not in self.replicas:
                r = _Replica(self._rid, key, self.capacity)
                r.version = self.version
                r.borrowed = key in self._borrowed
                self._rid += 1
                self.replicas[key] = r
                heapq.heappush(self._load_heap, (0, r.rid, r))
        for s in orphans:  # tasks in flight continue on other replicas (sticky tasks now waiting: on return)
            self.counters["moved_tasks"] += 1
            s.replica = None
            self._place(s)
        if self.replicas and self._parked:
            parked, self._parked = self._parked, []
            for s in parked:
                self._place(s)
        if self._routing:  # the live list the router sees changed: what it holds is offered again
            self.router.changed()

    def _rebalance(self, targets: list) -> None:
        """New replicas take queued tasks that hold no KV (tails first) from replicas above the mean load (with
        SimConfig.router, the router alone places: a new replica is one more in the live list it sees)."""
        if not targets or self._routing:
            return
        share = sum(r.live for r in self.replicas.values()) // len(self.replicas)
        movable = []
        now = self.loop._now
        for r in sorted(self.replicas.values(), key=lambda r: -r.live):
            if r.borrowed or r.live <= share:
                continue
            self._arrived(r, now)  # (queued at once, as far as this is concerned)
            excess = r.live - share
            for q in (r.pending, r.queue):
                for s in reversed(list(q)):
                    if excess <= 0:
                        break
                    if s.pinned or s.kv_pages or s.run >= 0:
                        continue
                    q.remove(s)
                    entry = r.cache.pop(s, None)
                    if entry is not None:
                        r.cache_pages -= entry[0]
                    if s.admitted:
                        r.footprints -= s.footprint
                    self._set_live(r, -1)
                    movable.append(s)
                    excess -= 1
        i = 0
        for s in movable:
            for _ in range(len(targets)):
                t = targets[i % len(targets)]
                i += 1
                if t.live < share:
                    break
            else:
                t = targets[i % len(targets)]
            s.replica = t
            self._set_live(t, +1)
            if s.admitted:
                t.footprints += s.footprint
            self.counters["moved_tasks"] += 1
            self._enqueue(t, s)

    def _pick(self) -> _Replica:
        """The alive replica with the fewest live tasks (lowest id on ties), from a lazy heap."""
        r: _Replica
        while self._load_heap:
            live, rid, r = self._load_heap[0]
            if not r.alive or live != r.live:
                heapq.heappop(self._load_heap)
                continue
            return r
        raise RuntimeError("no rollout replica")

    def _set_live(self, r: _Replica, delta) -> None:
        r.live += delta
        if r.alive:
            load = self._load_heap
            if len(load) > 4 * len(self.replicas) + 64:  # stale entries sink and stay: rebuilt from the replicas
                load = self._load_heap = [(q.live, q.rid, q) for q in self.replicas.values()]
                heapq.heapify(load)
            else:
                heapq.heappush(load, (r.live, r.rid, r))

    def _place(self, seq: _Seq) -> None:
        if self._routing:  # SimConfig.router: offered to the router at its next call (router.py)
            self.router.offer(seq)
            return
        if not self.replicas:  # every rollout replica is lent out (BiDiRL): it waits for their return
            seq.replica = None
            self._parked.append(seq)
            return
        r = self._pick()
        seq.replica = r
        self._set_live(r, +1)
        if seq.admitted:  # a task moved off a removed replica keeps its CTB admission
            r.footprints += seq.footprint
        self._enqueue(r, seq)

    def _enqueue(self, r: _Replica, seq: _Seq) -> None:
        """`seq` joins `r`'s queue now: at the end of the event in flight, or at this instant once the loop
        is quiet if `r` is idle (all enqueues of the instant made before then join its first event)."""
        now: float = self.loop._now
        self._order += 1
        heapq.heappush(r.arrivals, (now, self._order, seq))
        if r.busy:
            self._cut(r, now)
        else:
            self._schedule(r, now)

    def _env_return(self, seq: _Seq) -> None:
        if self._routing:  # a continuation: the router places it (`_assign`)
            self.router.offer(seq)
            return
        r = seq.replica
        if r is None or not r.alive:  # its replica was moved away meanwhile
            if r is not None:
                r.live -= 1
            self.counters["moved_tasks"] += 1
            seq.pinned, seq.kv_pages = False, 0
            self._place(seq)
        else:
            self._enqueue(r, seq)

    def _assign(self, seq: _Seq, r: _Replica) -> None:
        """The router placed `seq` on `r` (SimConfig.router, router.py). A task placed off the live replica that
        holds its KV leaves it there: pinned KV (CTB) becomes that replica's prefix cache, its group's prompt is
        no longer held there by it, and its context is recomputed where it lands (less what `r` has cached); a
        task whose replica was removed meanwhile lost its KV with it."""
        old = seq.replica
        if old is not r:
            if old is not None and old.alive:
                self._set_live(old, -1)
                if seq.admitted:
                    old.footprints -= seq.footprint
                if seq.pinned:
                    del old.pinned[seq]
                    seq.pinned = False
                    old.used -= seq.kv_pages
                    full = (seq.ctx - seq.new_tokens) // self.ps
                    old.cache[seq] = (seq.kv_pages, full * self.ps, seq.kv_version)
                    old.cache_pages += seq.kv_pages
                    seq.kv_pages = 0
                self._drop_prompt(old, seq)
            elif old is not None:  # its replica was removed while it waited (its KV went with it)
                seq.pinned, seq.kv_pages = False, 0
                self.counters["moved_tasks"] += 1
            seq.replica = r
            self._set_live(r, +1)
            if seq.admitted:
                r.footprints += seq.footprint
        self._enqueue(r, seq)

    def _route_soon(self) -> None:
        """The router is called at this instant, after what is already on the heap for it (router.py)."""
        now: float = self.loop._now
        self._order += 1
        heapq.heappush(self._heap, (now, self._order, None))
        if not self._driving:
            self._arm(now)

    # ---------------------------------------------------------------- serving

    def _decode_step(self, batch: int, context_tokens: float) -> float:
        """`costs.decode_step_time(shape, hw, batch, context_tokens, devices=tp, eff)`, its constants cached."""
        flops = 2.0 * self._matmul_params * batch + self._attn_per_pair * context_tokens
        bytes_moved = self._param_bytes + self._kv_bytes * (context_tokens + batch)
        return max(flops / self._flops_rate, bytes_moved / self._bytes_rate)

    def _wake(self, r: _Replica) -> None:
        """`r` at a chunk boundary (`wake_at`): what arrived meanwhile joins the queue, the span's events
        end (their turns end, each at its own step), then what fits is admitted and the next span starts:
        the new sequences' prefill and K decode steps of all, event after event until one ends a turn or
        something arrives (`_walk`); idle without running sequences."""
        now: float = self.loop._now
        if now != r.wake_at or not r.alive:  # stale: re-timed (`_cut`, `_rescale_rollout`) or moved away
            return
        r.wake_at = _INF
        arrivals = r.arrivals
        if arrivals and arrivals[0][0] <= now:  # (before the turns below add their environment returns)
            self._arrived(r, now)
        busy = r.busy
        if busy:  # (it stays busy if it goes on: no zero-length idle gap)
            self._events += r.w_chunks
            if self._busy_lane:
                self._add_busy(r, r.w_dur)
            elif self._span_lane:
                self._span_busy += r.w_dur * self._replica_devices
            self._load_steps += r.w_step - r.steps
            self._load_busy += r.w_dur
            if self._routing:  # the router's tokens/s of this replica, in virtual time
                r.r_busy += r.w_dur
                r.r_tokens += r.span_batch * (r.w_step - r.steps)
            r.steps = last = r.w_step
            ends = r.ends
            if ends and ends[0][0] <= last:  # turns of the span's last event (none end before it)
                start, first, step = r.w_start + r.w_prefill, r.w_first, r.w_step_s
                pop = heapq.heappop
                at_end = self._engine_steps  # the engine's call returns them all at once
                s: _Seq
                while ends and ends[0][0] <= last:
                    end, _, s = pop(ends)
                    self._retire(r, s)
                    self._turn_end(r, s, now if at_end else start + (end - first) * step)
        admitted = False
        if r.queue or r.pending or r.prefilling:
            before = self._admissions
            prefill = self._admit(r)
            admitted = self._admissions != before
            if self._host_jobs:  # measured costs, cores shared with a train / ref job
                prefill *= self.measured.rollout_overlap_x
        else:
            prefill = 0.0
        # (read by `_walk` with SimConfig.engine_steps: `Engine.step` decodes 1 step when it prefills or a turn waits)
        r.one_step = admitted or bool(r.queue) or bool(r.prefilling)
        B = len(r.running)
        self._load_prefill += prefill
        if (B or prefill) and self._call_overhead:  # measured costs: the rollout loop's host time per engine call
            prefill += self._call_overhead * (self.measured.rollout_overlap_x if self._host_jobs else 1.0)
        if B and self._program_s:  # the decode program of this batch's shape bucket, if this engine lacks it
            K = 1 if r.one_step else self._chunk
            steps = r.steps
            pages = max(-(-(s.ctx0 + steps - s.start + K - 1) // self.ps) for s in r.running)
            key = ("decode", _bucket(B, self._decode_rows), _bucket(pages, self._decode_pages))
            prefill += self._program(r, key) * (self.measured.rollout_overlap_x if self._host_jobs else 1.0)
        if not B and not prefill:  # idle until something arrives
            r.retry = False
            if busy:
                self._busy_end(r, 0.0)
            if arrivals:
                self._schedule(r, arrivals[0][0])
            return
        steps = r.steps
        if r.vlog[-1][1] != r.version:
            r.vlog.append((steps, r.version))
        r.span_start, r.span_prefill, r.span_steps, r.span_batch = now, prefill, steps, B
        r.span_ctx_base, r.span_maxend, r.span_first_end = r.ctx_base, r.maxend, r.ends[0][0] if B else steps
        end: float
        if r.retry:
            r.retry = False
            end = self._walk(r, now)
        else:
            end = self._walk(r, arrivals[0][0] if arrivals else _INF)
        if not busy:
            r.busy = True
            self._busy_replicas += 1
            if self._busy_replicas == 1:
                self._busy_first()
        span = end - now
        self._load_running += B * span
        self._load_queued += (len(r.queue) + len(r.pending)) * span
        r.wake_at = end  # (`_drive` runs this: no loop timer to arm)
        self._order += 1
        heapq.heappush(self._heap, (end, self._order, r))

    def _arrived(self, r: _Replica, now: float) -> None:
        """What arrived at `r` by `now` joins its queue (CTB: a task not admitted yet, task admission's)."""
        s: _Seq
        arrivals, pending, queue, ctb_mode = r.arrivals, r.pending, r.queue, self._ctb
        pop = heapq.heappop
        while arrivals and arrivals[0][0] <= now:
            s = pop(arrivals)[2]
            (pending if ctb_mode and not s.admitted else queue).append(s)

    def _walk(self, r: _Replica, until: float) -> float:
        """Times the events of `r`'s span (`r.span_*`) up to the first that ends after `until` or ends a
        turn (with measured costs: the first, whose time `_rescale_rollout` may change); sets `r.w_*`
        and returns when that event ends. Event by event (K = min(decode_chunk, the longest turn's steps
        left), B running sequences whose `context` tokens grow by B per step):

            seconds = prefill (the span's first event) + K * decode_step_time(B, context + B * (K - 1) / 2)

        accumulated in the order, and so to the last bit, of timing each event on its own heap entry."""
        start, prefill, steps, B = r.span_start, r.span_prefill, r.span_steps, r.span_batch
        ctx_base, maxend, first_end = r.span_ctx_base, r.span_maxend, r.span_first_end
        chunk = self._chunk
        t = start
        dur = 0.0
        n = 0
        m = self.measured
        if m is None:
            attn, decode_flops, flops_rate = self._attn_per_pair, self._decode_flops * B, self._flops_rate
            param_bytes, kv_bytes, bytes_rate = self._param_bytes, self._kv_bytes, self._bytes_rate
            spec, spec_max = self._spec, war.SPEC_MAX_BATCH
            while True:
                K = maxend - steps
                if K > chunk:
                    K = chunk
                # self._decode_step(B, context + B * (K - 1) / 2), inlined (the hottest line of a simulation)
                context = ctx_base + B * steps + B * (K - 1) / 2
                step = (decode_flops + attn * context) / flops_rate
                b = (param_bytes + kv_bytes * (context + B)) / bytes_rate
                if b > step:
                    step = b
                if spec and B <= spec_max:  # WAR: seconds per emitted token with a verify step, if it pays
                    step = self._spec_step(B, context, step)
                d = prefill + K * step
                prev = t
                t += d
                dur += d
                n += 1
                first = steps
                steps += K
                if steps >= first_end or t > until:
                    break
                prefill = 0.0
        else:
            if self._engine_steps:  # `Engine.step`: 1 step in a call that prefills or leaves a turn waiting
                K = (1 if r.one_step else chunk) if B else 0  # (no decode while all it runs still prefill)
            else:
                K = maxend - steps
                if K > chunk:
                    K = chunk
            step = m.decode_step_s + m.decode_per_seq_s * B
            if m.decode_per_kv_token_s:  # attention over the running sequences' context (as the roofline's)
                step += m.decode_per_kv_token_s * (ctx_base + B * steps + B * (K - 1) / 2)
            if self._host_jobs:
                step *= m.rollout_overlap_x
            d = prefill + K * step
            prev = t
            t += d
            dur, n, first = d, 1, steps
            steps += K
        r.w_step, r.w_prev, r.w_chunks, r.w_dur = steps, prev, n, dur
        r.w_start, r.w_prefill, r.w_first, r.w_step_s = prev, prefill, first, step
        return t

    def _spec_step(self, B: int, context: float, t_decode: float) -> float:
        """WAR's switch (`war.speculation_pays`, `use_speculation`'s rule) for one event: a verify step scores
        `spec_draft_tokens` + 1 tokens of each of the B sequences over the same context (roofline) and emits
        `spec_accepted_tokens` of them; returns the seconds per emitted token, with or without it."""
        cfg = self.cfg
        n = B * (cfg.spec_draft_tokens + 1)
        flops = self._decode_flops * n + self._attn_per_pair * context * (cfg.spec_draft_tokens + 1)
        t_spec = max(flops / self._flops_rate, (self._param_bytes + self._kv_bytes * (context + n)) / self._bytes_rate)
        accepted = cfg.spec_accepted_tokens
        return t_spec / accepted if war.speculation_pays(B, t_spec, accepted, t_decode) else t_decode

    def _cut(self, r: _Replica, at: float) -> None:
        """The span in flight on `r` ends with its first event that ends after `at` (something arrived,
        or the weights or CTB's footprint estimate changed: the next event sees it)."""
        if at < r.w_prev:  # (else that is the span's last event already)
            self._schedule(r, self._walk(r, at))

    def _schedule(self, r: _Replica, at: float) -> None:
        """`r` wakes at `at` if that is earlier than its wake now (the later heap entry goes stale)."""
        if at < r.wake_at:
            r.wake_at = at
            self._order += 1
            heapq.heappush(self._heap, (at, self._order, r))
            if not self._driving:
                self._arm(at)

    def _retire(self, r: _Replica, s: _Seq) -> None:
        """Takes `s` off the running set, bringing its counts up to the replica's decode steps."""
        del r.running[s]
        s.run = -1
        r.ctx_base -= s.ctx0 - s.start
        k = min(s.end, r.steps) - s.start
        if k <= 0:
            return
        s.left -= k
        s.ctx += k
        s.written += k
        self._decode_tokens += k
        versions, a, hi = s.versions, s.start, s.start + k
        vlog = r.vlog
        at, v = vlog[-1]
        if at <= a:  # one version all turn
            versions[v] = versions.get(v, 0) + k
            return
        for i in range(len(vlog) - 1, -1, -1):
            at, v = vlog[i]
            if hi > at:
                lo = at if at > a else a
                versions[v] = versions.get(v, 0) + hi - lo
                hi = lo
            if at <= a:
                break

    def _rescale_rollout(self, f: float) -> None:
        """Stretches (f > 1) or shrinks the rest of every busy replica's event by `f`."""
        now = self.loop._now
        for r in self.replicas.values():  # measured costs: a span is one event (`_walk`)
            if not r.busy or r.wake_at <= now:
                continue
            prefill, step = r.w_prefill, r.w_step_s
            K = r.w_step - r.w_first
            start = now + (r.w_start - now) * f  # then start + prefill + k * step = now + (old - now) * f
            r.w_start, r.w_prefill, r.w_step_s = start, prefill * f, step * f
            end = start + (prefill + K * step) * f
            r.w_dur = end - r.span_start
            r.wake_at = _INF
            self._schedule(r, end)

    # ---------------------------------------------------------------- the event heap

    def _arm(self, at: float) -> None:
        if self._armed is not None:
            if self._armed_at <= at:
                return
            self._armed.cancel()
        self._armed, self._armed_at = self.loop.call_at(at, self._drive), at

    def _drive(self) -> None:
        """Runs heap events in time order, advancing the virtual clock itself while nothing else on
        the loop could happen first (`VirtualTimeLoop.quiet_until`); stops when an asyncio callback
        becomes ready (a finished sample wakes the controller) or a loop timer comes first."""
        self._armed = None
        heap, loop = self._heap, self.loop
        pop = heapq.heappop
        ready = loop._ready  # asyncio's ready queue: non-empty once a finished sample wakes a task
        # the next loop timer: heap events never schedule loop timers, so it holds while driving
        limit: float = loop.quiet_until()
        now: float = loop._now
        self._driving = True
        try:
            while heap:
                at: float = heap[0][0]
                if at > now:
                    if at > limit or ready:
                        break
                    loop._now = now = at
                x = pop(heap)[2]
                if type(x) is _Replica:
                    self._wake(x)
                elif x is None:  # SimConfig.router: a routing call (`_route_soon`)
                    self.router.call()
                else:
                    self._env_return(x)
        finally:
            self._driving = False
        if heap:
            self._arm(heap[0][0])

    def _turn_end(self, r: _Replica, s: _Seq, at: float) -> None:
        turn = s.turn
        if turn + 1 >= len(s.gen) or turn >= len(s.obs):  # the task ends
            self._finish(r, s)
            return
        obs = s.obs[turn]
        latency = s.latency[turn]
        s.turn = turn + 1
        s.left = s.gen[turn + 1]
        if self._ctb:  # KV kept and pinned; the reservation shrinks to the context
            keep = -(-s.ctx // self.ps)
            r.used -= s.kv_pages - keep
            s.kv_pages = keep
            s.pinned = True
            r.pinned[s] = None
        else:  # the turn's KV becomes prefix cache (full pages), keyed by this version
            r.used -= s.kv_pages
            full = s.ctx // self.ps
            r.cache[s] = (full, full * self.ps, s.kv_version)
            r.cache_pages += full
            s.kv_pages = 0
        s.ctx += obs
        s.new_tokens = obs  # a pinned resume prefills only the observation
        s.tokens_added = s.ctx - s.prompt
        if s.admitted:
            f = self._footprint(s)
            r.footprints += f - s.footprint
            s.footprint = f
        s.wait_started = at
        at += latency
        now: float = self.loop._now
        self._order += 1
        if self._routing:  # the continuation goes to the router when its observation is back (`_env_return`)
            at = at if at > now else now
            heapq.heappush(self._heap, (at, self._order, s))
            if not self._driving:
                self._arm(at)
            self.router.changed()  # this replica's load fell: what the router holds may fit now
            return
        heapq.heappush(r.arrivals, (at if at > now else now, self._order, s))  # `_wake` schedules its wake

    def _finish(self, r: _Replica, s: _Seq) -> None:
        r.used -= s.kv_pages
        s.kv_pages = 0
        r.footprints -= s.footprint
        s.footprint = 0
        self._drop_prompt(r, s)
        self._set_live(r, -1)
        if self._routing:
            self.router.ended_task(s)
        self._finished.append(len(s.gen))
        self._finishes += 1
        if self._finishes % self._finished_window == 0 or self._finishes < self._finished_window:
            self._remaining_turns.clear()
            self._window = tuple(self._finished)
            now: float = self.loop._now
            for q in self.replicas.values():  # the footprints of tasks awaiting admission changed
                if q.pending and q.busy:
                    self._cut(q, now)
        w: _Waiter = s.future
        w.left -= 1
        if w.left == 0 and not w.future.done():
            w.future.set_result(None)

    def _drop_prompt(self, r: _Replica, s: _Seq) -> None:
        """`s` no longer holds its group's prompt on `r` (it ended, or moved away)."""
        p = r.prompts.get(s.gid)
        if p is not None:
            p[1] -= 1
            if p[1] <= 0:
                del r.prompts[s.gid]

    # ---------------------------------------------------------------- busy accounting

    def _add_busy(self, r: _Replica, seconds: float) -> None:
        """`seconds` of events of `r` into the rollout lane's busy time (`_busy_lane`: with `attach`, lanes
        not shared)."""
        m = self.metrics
        if r.borrowed:  # train devices doing rollout work: the train lane's busy time
            m.busy_device_s["train"] += seconds * self._replica_devices
        else:
            n = self._rollout_devices or 1
            m.busy_device_s["rollout"] += seconds * self._replica_devices
            m.busy_s["rollout"] += seconds * self._replica_devices / n

    def _busy_first(self) -> None:
        """The first busy replica of the pool (`_wake` counts them): a rollout span opens."""
        if self._flip is not None:
            self._rollout_flipped()
        if self.metrics is not None:
            self._busy_since = self.metrics.now()
        elif self._step_span is not None:
            self._span_ctx = self._step_span()
            self._span_ctx.__enter__()

    def _busy_end(self, r: _Replica, seconds: float) -> None:
        if not r.busy:
            return
        r.busy = False
        self._busy_replicas -= 1
        if self._busy_lane:
            self._add_busy(r, seconds)
        elif self._span_lane:
            self._span_busy += seconds * self._replica_devices
        m = self.metrics
        if self._busy_replicas == 0:
            if self._flip is not None:
                self._rollout_flipped()
            if m is not None:
                start, end = self._busy_since, m.now()
                m.spans.append(("rollout", "generate", start, end))
                if self._shared:
                    m.busy_device_s["rollout"] += (end - start) * m.devices.get("rollout", 0)
                    m.busy_s["rollout"] += end - start
                    # replicas that had nothing to run while others generated (a batch's tail)
                    idle = (end - start) * m.devices.get("rollout", 0) - self._span_busy
                    m.idle_in_spans["rollout"] += max(0.0, idle)
                    self._span_busy = 0.0
            elif self._span_ctx is not None:
                ctx, self._span_ctx = self._span_ctx, None
                ctx.__exit__(None, None, None)
