"""The trainer's and the reference scorer's costs in `SimBackend` (`TrainerCosts`, a plain-Python base of
it: these run a few times per step, not per event, so they are not compiled), each job an `asyncio.sleep` of
its cost on the virtual clock.

What is modelled (parameters in `config.SimConfig`):

- **Train** (`train_step_time`), **proximal and reference scoring** (`score_time`) over all context
  tokens of the batch, mean sequence length for attention; ref scored on the train devices unless
  the trajectories carry scores from the ref devices (RA2P decoupled). Ref jobs run one at a time.
  A train step on rollout replicas the trainer borrowed (BiDiRL, switches.py) pays their gradient
  all-reduce and counts as the rollout lane's busy time.
- **Measured costs** (`SimConfig.measured`, `costs.MeasuredCosts`; benchmarks/sim_validation.py): per-op
  times measured on a host replace the roofline, and train / ref jobs share the cores with the rollout
  by processor sharing (`_host_work`: each side advances at 1 / its measured overlap factor while the other
  works; in-flight replica events are re-timed when the first job starts and the last one ends:
  `ReplicaCore._rescale_rollout`). The trainer and the ref scorer load
  their programs (`score_program_s`, `update_program_s`, `ref_program_s`) at their first batch of each
  packed micro-batch count, per backend (each real run builds its own) and again after a move of their
  devices (switches.py); `compile_s` counts those calls as the real backend does, and with them simulated it
  is ERS's move-cost estimate before any move (as for the real controller, whose backend gives none).
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.sim import costs


class TrainerCosts:
    """Train and ref jobs of `SimBackend` (see the module docstring; its state is set by `SimBackend.__init__`)."""

    async def score_ref(self, trajectories: Sequence[Trajectory]) -> tuple[list, bool]:
        tokens, seq_len = _tokens(trajectories)
        async with self._ref_lock:
            m = self.measured
            if m is None:
                # a job queued across an ERS move that took the last ref group runs on the train devices
                devices = len(self._devices("ref")) or len(self._devices("train"))
                seconds = costs.score_time(self.shape, self.hw, tokens, devices=devices,
                                           seq_len=seq_len, eff=self.eff)
            else:
                micro = self._micro(trajectories)
                load = self._train_program("ref", micro, m.ref_program_s)
                seconds = m.ref_fixed_s + m.ref_per_token_s * tokens + m.ref_per_micro_s * micro + load
                self._compiled_s += seconds if load else 0.0  # (the scorer's first call, load and run)
            await self._host_work(seconds)
        return [0.0] * len(trajectories), False

    async def _host_work(self, seconds: float) -> None:
        """A train or ref job of `seconds` (alone). Measured costs with shared cores: processor
        sharing with the rollout, both ways: while any replica is busy the job advances at
        1 / `train_overlap_x` of its speed, and while a job runs the busy replicas' events advance at
        1 / `rollout_overlap_x` of theirs (their remaining time is stretched when the first job
        starts and shrunk back when the last one ends)."""
        m = self.measured
        if m is None or (m.train_overlap_x == 1 and m.rollout_overlap_x == 1):
            await asyncio.sleep(seconds)
            return
        if self._host_jobs == 0:
            self._rescale_rollout(m.rollout_overlap_x)
        self._host_jobs += 1
        try:
            loop, left = self.loop, seconds
            while left > 1e-12:
                x = m.train_overlap_x if self._busy_replicas else 1.0
                if self._flip is None or self._flip.done():
                    self._flip = loop.create_future()
                flip, t0 = self._flip, loop.time()
                timer = loop.call_at(t0 + left * x, lambda f=flip: f.done() or f.set_result(None))
                try:
                    await flip
                finally:
                    timer.cancel()
                left -= (loop.time() - t0) / x
        finally:
            self._host_jobs -= 1
            if self._host_jobs == 0 and self._started:  # (a job cancelled at the end: the loop may be closed)
                self._rescale_rollout(1.0 / m.rollout_overlap_x)

    def _rollout_flipped(self) -> None:
        """The rollout went idle or busy: host jobs re-time themselves (`_host_work`)."""
        flip = self._flip
        if flip is not None and not flip.done():
            flip.set_result(None)

    async def train(self, trajectories: Sequence[Trajectory]) -> dict:
        tokens, seq_len = _tokens(trajectories)
        n = len(self._devices("train")) + self._train_extra
        m = self.measured
        if m is None:
            proximal = costs.score_time(self.shape, self.hw, tokens, devices=n, seq_len=seq_len, eff=self.eff)
            update = costs.train_step_time(self.shape, self.hw, tokens, devices=n, seq_len=seq_len, eff=self.eff)
        else:
            micro = self._micro(trajectories)
            proximal = m.score_fixed_s + m.score_per_token_s * tokens + m.score_per_micro_s * micro
            update = m.update_fixed_s + m.update_per_token_s * tokens + m.update_per_micro_s * micro
        has_ref = bool(trajectories) and all(t.info.get("ref_logp") is not None for t in trajectories)
        ref = 0.0 if has_ref else proximal
        if not has_ref and self.cfg.ref_swap:  # (StreamRL) a weight swap in and back per micro-batch (group)
            swap = 2 * self.shape.param_bytes / max(1, n) / self.cfg.host_bandwidth
            ref += swap * len({t.group for t in trajectories})
        if m is not None:  # a program shape this trainer has not run yet: its first call loads it (the colocated
            # ref pass then finds the score program loaded)
            loads = self._train_program("score", micro, m.score_program_s), self._train_program(
                "update", micro, m.update_program_s)
            proximal, update = proximal + loads[0], update + loads[1]
            # `Trainer.compile_s` counts the whole first call of a program (its load and its run)
            self._compiled_s += (proximal if loads[0] else 0.0) + (update if loads[1] else 0.0)
        if self._train_extra:  # borrowed replicas merge their gradients
            update += self.switch_costs("rollout", "train")["merge_s"]
        t0 = self.loop.time()
        await self._host_work(proximal + ref + update)
        if self._train_extra and self.metrics is not None:  # the borrowed rollout devices were busy
            self.metrics.busy_device_s["rollout"] += (self.loop.time() - t0) * self._train_extra
        return dict(tokens=float(sum(t.model_tokens for t in trajectories)), reward=0.0, loss=0.0,
                    time_proximal_s=proximal, time_ref_s=ref, time_update_s=update, compile_s=0.0)

    def _train_program(self, program: str, micro: int, seconds: float) -> float:
        """`seconds` the first time this trainer / scorer runs `program` on `micro` micro-batches, else 0
        (`Trainer._program`: a jitted program per packed shape, loaded or compiled at its first call)."""
        if not seconds or (program, micro) in self._train_programs:
            return 0.0
        self._train_programs.add((program, micro))
        return seconds

    def _micro(self, trajectories: Sequence[Trajectory]) -> int:
        """The trainer's micro-batches for these trajectories (SimConfig.train_row_len; 0 without it)."""
        if not self.cfg.train_row_len or not self.cfg.train_micro_rows:
            return 0
        return costs.packed_micro_batches([getattr(t, "context_tokens", 0) or len(t.tokens) for t in trajectories],
                                          self.cfg.train_row_len, self.cfg.train_micro_rows)


def _tokens(trajectories: Sequence[Trajectory]) -> tuple[int, float]:
    """All context tokens of a batch (a forward pass reads them all) and the mean sequence length."""
    total = sum(getattr(t, "context_tokens", 0) or len(t.tokens) for t in trajectories)
    return total, total / max(1, len(trajectories))
