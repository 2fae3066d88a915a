"""BiDiRL's borrowing inside the controller's step (docs/mechanisms.md, BiDiRL; rules in `policies/bidirl.py`).

Within a step, the pool that waits lends its idle devices to the other, only if `bidirl.decide_borrow`
predicts a gain above switch-in + switch-out (+ the gradient merge when the trainer borrows): while the trainer
waits for data the rollout may borrow the train devices until the batch is ready; while the producer is blocked
by the staleness bound, the trainer may borrow the rollout devices that have no task, for one train step. The
gain model's `scaling` is re-measured after each rollout borrow from the sample arrival rate during it versus
before it. The switch costs weighed are the backend's (`switch_costs`: measured switches on the JAX backend,
`runtime/hot_switch.py`; the cost model's on the simulator), and each borrow record keeps them beside the switch
seconds measured here. A mixin of `Controller` (its state is the controller's: pool, backend, timings, arrivals).
"""

from __future__ import annotations

import logging
import math

from tiderl_jax.policies import bidirl

log = logging.getLogger("tiderl_jax.runtime.controller")


class Borrowing:
    def _arrival_rate(self, since: float = -math.inf) -> float | None:
        """Fresh samples per second over the recent ready groups (arrived after `since`)."""
        pts = [(t, n) for t, n in self._arrivals if t > since]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return sum(n for _, n in pts[1:]) / (pts[-1][0] - pts[0][0])

    async def _borrow(self, what: str, signals: bidirl.BorrowSignals | None, blocking: bool = False):
        """Asks `bidirl.decide_borrow` (None signals: nothing to borrow); on yes, the backend switches the devices
        over. Returns what `_return_borrowed` needs, or None. Across processes it is process 0's decision from
        its signals (every process calls this at the same point of the step), and every process lends
        (`blocking`: `Multihost._decided`'s)."""
        d = await self._decided(f"BiDiRL {what} at step {self.step + 1}",
                                lambda: None if signals is None else bidirl.decide_borrow(signals), blocking)
        if d is None:
            return None
        if not d.borrow:
            self.borrows_refused += 1
            log.debug("BiDiRL: %s does not borrow (%s)", d.borrower, d.reason)
            return None
        t0 = self.clock()
        await self.backend.lend(d.lender, d.borrower, d.devices)
        # switch_in_s / switch_out_s: as measured here (wall on the backend's clock); predicted_*: what was weighed
        record = dict(step=self.step, borrower=d.borrower, devices=d.devices, predicted_gain_s=d.gain_s,
                      predicted_cost_s=d.cost_s, predicted_switch_in_s=getattr(signals, "switch_in_s", 0.0),
                      predicted_switch_out_s=getattr(signals, "switch_out_s", 0.0),
                      remaining_s=getattr(signals, "remaining_s", 0.0), start=t0,
                      switch_in_s=self.clock() - t0, rate_before=self._arrival_rate())
        if signals is None:  # process 0 decided (multi-host): this process's own view was not weighed
            record.update(predicted_switch_in_s=float("nan"), predicted_switch_out_s=float("nan"),
                          remaining_s=float("nan"))
        log.info("BiDiRL: %s borrows %d %s device(s) (%s)", d.borrower, d.devices, d.lender, d.reason)
        return record

    async def _return_borrowed(self, record: dict) -> None:
        t0 = self.clock()
        await self.backend.take_back()
        record.update(switch_out_s=self.clock() - t0, held_s=t0 - record["start"])
        if record["borrower"] == bidirl.ROLLOUT:  # measure what the borrowed devices added
            during, before = self._arrival_rate(since=record["start"] + record["switch_in_s"]), record["rate_before"]
            if during is not None and before:
                self.bidirl_scaling = bidirl.measured_scaling(before, during, len(self.pool.devices_of("rollout")),
                                                              record["devices"])
                record["measured_scaling"] = self.bidirl_scaling
        self.borrows.append(record)

    async def _rollout_borrow(self, batch: list):
        """The trainer is about to wait for data: the rollout may borrow the train devices until the
        batch is ready (the predicted wait: samples missing / recent arrival rate)."""
        have = sum(len(g.trajectories) for g in list(self.ready) + batch)
        missing = self.cfg.batch_samples - have
        rate = self._arrival_rate()
        if missing <= 0 or not rate or self.pool is None:
            return await self._borrow("rollout borrow", None)
        costs = self.backend.switch_costs(bidirl.TRAIN, bidirl.ROLLOUT)
        remaining = missing / rate
        return await self._borrow("rollout borrow", bidirl.BorrowSignals(
            borrower=bidirl.ROLLOUT, remaining_s=remaining, own_devices=len(self.pool.devices_of("rollout")),
            idle_devices=len(self.pool.devices_of("train")), idle_for_s=remaining,
            switch_in_s=costs["switch_in_s"], switch_out_s=costs["switch_out_s"],
            borrower_unit=self.backend.borrow_unit(bidirl.ROLLOUT), scaling=self.bidirl_scaling))

    async def _train_borrow(self):
        """The trainer may borrow rollout devices that have no task while admission is blocked by the
        staleness bound (they stay idle until this step's version is published)."""
        remaining = self._timings.get("train_own", 0.0)
        can = self._producer_blocked and remaining > 0 and self.pool is not None
        idle = self.backend.idle_devices(bidirl.ROLLOUT) if can else 0
        # across processes these exchanges block the loop: no task may reach a replica counted idle before it is
        # lent (every process lends as many; the processes are in step here, right after the batch exchange)
        if self.cluster.multi:  # every process lends as many: the fewest any has idle
            idle = min(self.cluster.allgather(f"BiDiRL idle rollout devices at step {self.step + 1}", idle))
        if idle <= 0:
            return await self._borrow("train borrow", None, blocking=True)
        costs = self.backend.switch_costs(bidirl.ROLLOUT, bidirl.TRAIN)
        return await self._borrow("train borrow", bidirl.BorrowSignals(
            borrower=bidirl.TRAIN, remaining_s=remaining, own_devices=len(self.pool.devices_of("train")),
            idle_devices=idle, idle_for_s=math.inf, switch_in_s=costs["switch_in_s"],
            switch_out_s=costs["switch_out_s"], merge_s=costs["merge_s"],
            borrower_unit=self.backend.borrow_unit(bidirl.TRAIN), scaling=1.0), blocking=True)

