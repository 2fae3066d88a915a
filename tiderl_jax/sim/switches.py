"""Device switches of `SimBackend` (`Switches`, a plain-Python base of it: a few per run, not compiled):
ERS's moves of device groups between roles and BiDiRL's hot switches within a step. The replica set they
change is rebuilt by `ReplicaCore._rebuild`, and replicas on borrowed train devices are filled by
`ReplicaCore._rebalance` (replicas.py: they change the event core's state, so they are compiled with it).

What is modelled (parameters in `config.SimConfig`):

- **Moves** (`switch_time`: `switch_fixed_s` plus the role's state: bf16 weights for rollout, plus
  `optimizer_bytes_per_param` for train, arriving on the moved group's devices).
- **BiDiRL borrowing** (`lend` / `take_back`, the controller's `bidirl` option): a hot switch of idle
  devices for part of a step (`switch_costs`, ours after BiDiRL's divisible layouts, where both roles'
  programs are resident on every pool):
  - the rollout borrows train devices while the trainer waits for data: switch-in offloads the
    trainer's optimizer state from them (`switch_time` of those bytes), then `tp`-device replicas
    serve on them and take over queued work that has no KV yet from the most loaded replicas
    (`_rebalance`); giving them back drops what they run (their tasks continue elsewhere without
    KV) and reloads the optimizer state;
  - the trainer borrows rollout replicas that have no task while admission is blocked: switch-in
    loads weights and optimizer state onto them, the train step runs on the extra devices and pays
    a gradient all-reduce across them (`merge_s`: 2 x bf16 gradients over the link), switch-out
    brings the weights back; the replicas return empty.
  Busy device-seconds go to the lane that owns the devices (borrowed replicas' events to the train
  lane, a borrowed train step to the rollout lane).
"""

from __future__ import annotations

import asyncio

from tiderl_jax.sim import costs


class Switches:
    """Moves and BiDiRL borrowing of `SimBackend` (see the module docstring; its state is set by
    `SimBackend.__init__`)."""

    async def move(self, from_role: str, to_role: str) -> None:
        group = self.pool.group_size
        self.pool = self.pool.moved(from_role, to_role)
        state = self.shape.param_bytes + (self.shape.params * self.cfg.optimizer_bytes_per_param
                                          if to_role == "train" else 0.0)
        seconds = costs.switch_time(state, self.hw, devices=group, span_devices=len(self._devices(to_role)),
                                    fixed_s=self.cfg.switch_fixed_s)
        if self.measured is not None:
            seconds = self.measured.switch_s
        # the trainer moved to a new mesh recompiles (`Trainer.move_to`); a ref group's move makes a new Scorer
        dropped = ({"score", "update"} if "train" in (from_role, to_role) else set()) | (
            {"ref"} if "ref" in (from_role, to_role) else set())
        self._train_programs = {k for k in self._train_programs if k[0] not in dropped}
        if from_role == "rollout":
            self._rebuild()  # its replicas stop now
        await asyncio.sleep(seconds)
        if to_role == "rollout":
            self._rebuild()  # new replicas serve once the weights are there

    # ---------------------------------------------------------------- BiDiRL borrowing

    def borrow_unit(self, role: str) -> int:
        """Devices per unit of `role` a borrow moves: a rollout replica, a trainer device group."""
        if role == "rollout":
            return self.cfg.tp or len(self._devices("rollout"))
        return self.cfg.tp or 1

    def switch_costs(self, lender: str, borrower: str) -> dict[str, float]:
        """Seconds of a BiDiRL hot switch of one borrower unit (module docstring)."""
        opt = self.shape.params * self.cfg.optimizer_bytes_per_param
        unit = self.borrow_unit(borrower)
        span = self.num_devices
        if self.measured is not None:
            return dict(switch_in_s=self.measured.switch_s, switch_out_s=self.measured.switch_s, merge_s=0.0)
        def t(state):
            return costs.switch_time(state, self.hw, devices=unit, span_devices=span, fixed_s=self.cfg.switch_fixed_s)
        if borrower == "rollout":
            return dict(switch_in_s=t(opt), switch_out_s=t(opt), merge_s=0.0)
        merge = costs.transfer_time(2 * 2.0 * self.shape.params, self.hw.link_bandwidth(span),
                                    streams=max(1, unit))
        return dict(switch_in_s=t(self.shape.param_bytes + opt), switch_out_s=t(self.shape.param_bytes),
                    merge_s=merge)

    def idle_devices(self, role: str) -> int:
        """Rollout devices whose replica has no task (placed, running, waiting or queued)."""
        if role != "rollout" or self.pool is None:
            return 0
        return sum(len(k) for k, r in self.replicas.items() if r.live == 0 and not r.busy and not r.borrowed)

    async def lend(self, lender: str, borrower: str, devices: int) -> None:
        """Switches `devices` idle devices of `lender` to `borrower` until `take_back`."""
        if self._borrowed or self._lent:
            raise RuntimeError("SimBackend.lend: devices are already lent (take_back first)")
        costs_ = self.switch_costs(lender, borrower)
        unit = self.borrow_unit(borrower)
        if lender == "train" and borrower == "rollout":
            devs = self._devices("train")[:devices]
            await asyncio.sleep(costs_["switch_in_s"])
            self._borrowed = [tuple(devs[i:i + unit]) for i in range(0, len(devs) - unit + 1, unit)]
            self._rebuild()
            self._rebalance([self.replicas[k] for k in self._borrowed])
        elif lender == "rollout" and borrower == "train":
            idle = [k for k, r in self.replicas.items() if r.live == 0 and not r.busy and not r.borrowed]
            chosen, n = [], 0
            for k in idle:
                if n + len(k) > devices:
                    break
                chosen.append(k)
                n += len(k)
            self._lent = set(chosen)
            self._rebuild()  # they stop serving now
            await asyncio.sleep(costs_["switch_in_s"])
            self._train_extra = n
        else:
            raise ValueError(f"SimBackend.lend: cannot lend {lender} devices to {borrower}")
        self._switch_out_s = costs_["switch_out_s"]

    async def take_back(self) -> None:
        """Ends the borrow: each device back in its own role after the switch-out."""
        if self._borrowed:
            self._borrowed = []
            self._rebuild()  # what they ran continues elsewhere, without its KV
            await asyncio.sleep(self._switch_out_s)
        elif self._lent:
            self._train_extra = 0
            await asyncio.sleep(self._switch_out_s)
            self._lent = set()
            self._rebuild()

    def move_cost_estimate(self) -> float:
        """What one ERS move of a device group costs here (the controller's economics before any move
        is measured): the measured switch time, or the roofline switch of a train group's state."""
        m = self.measured
        if m is not None:
            if self._program_s or m.score_program_s or m.update_program_s or m.ref_program_s:
                # program loads simulated: what the real controller weighs, with no estimate from its backend
                # (`Controller._ers_economics`): the program seconds so far, which a move to new meshes repeats
                return self._compiled_s
            return m.switch_s
        group = self.pool.group_size if self.pool is not None else self.num_devices
        state = self.shape.param_bytes + self.shape.params * self.cfg.optimizer_bytes_per_param
        return costs.switch_time(state, self.hw, devices=group, span_devices=self.num_devices,
                                 fixed_s=self.cfg.switch_fixed_s)
