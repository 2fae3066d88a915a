"""TideRL's step-boundary decisions inside the controller (docs/mechanisms.md: RA2P, ERS): RA2P's mode for the next
step (colocated or decoupled reference pass) and its device repartition, ERS's device-group move, each from the
measured times of the steps before (`_timings`, the lanes' busy seconds, the moves' measured costs) and each
logged with what it weighed. A mixin of `Controller` (its state is the controller's: pool, backend, timings).
"""

from __future__ import annotations

import logging
import math

from tiderl_jax.policies import ers, ra2p

log = logging.getLogger("tiderl_jax.runtime.controller")


class Boundaries:
    def _ra2p_decision(self, ras: int) -> ra2p.Decision | None:
        """RA2P's choice for the next step from measured per-micro-batch (= per-group) times: the
        actor and the colocated ref pass on the train devices, the decoupled ref pass on the ref
        devices (their speed ratio is D_ref; a time not yet measured is scaled from the other by
        device count). The actor keeps the train devices in both modes (D_act = 1); both weight
        sets stay resident, so colocated swaps nothing (T_swap = 0)."""
        if not self.backend.has_ref_devices:
            return None
        signals = self._ra2p_signals(ras)
        return None if signals is None else ra2p.choose_mode(signals)

    def _ra2p_signals(self, ras: int) -> ra2p.RA2PSignals | None:
        """RA2P's signals from the measured times (`_ra2p_decision`); None before they are measured."""
        t = self._timings
        if self.cfg.mode != "tiderl" or self.pool is None or t["t_act"] is None:
            return None
        if t.get("t_ref_col") is None and t.get("t_ref_dec") is None:
            return None
        n_ref, n_train = len(self.pool.devices_of("ref")), len(self.pool.devices_of("train"))
        t_col = t.get("t_ref_col") or t["t_ref_dec"] * n_ref / n_train
        t_dec = t.get("t_ref_dec") or (t_col * n_train / n_ref if n_ref else t_col)
        return ra2p.RA2PSignals(
            num_microbatches=self.run_cfg.groups_per_step, ready_at_start=ras, tprm_s=t["tprm"] or 0.0,
            t_ref_s=t_col, t_act_s=t["t_act"], t_swap_s=0.0, ref_share=t_col / max(t_dec, 1e-9),
            act_share=1.0)

    def _compile_seconds(self) -> float:
        return self.backend.compile_s()

    def _train_scaling(self) -> float:
        """The trainer's scaling as the backend knows it (the simulator's cost model), else as measured on the last
        move (faked CPU devices do speed up: goodput.py's trainer took 7-8 s per update on 4 of them, 11-13 s on 2)."""
        known = self.backend.train_scaling() if hasattr(self.backend, "train_scaling") else None
        return self.ers_scaling if known is None else known

    def _move_costs(self) -> tuple[float, dict]:
        """(a move's predicted seconds by default, {(from, to): seconds} where known): the last move as measured,
        else the backend's estimate if it has one (the simulator's switch time), else the compile seconds so far;
        per move where the backend can tell (the parts a move rebuilds), and the moves already made as measured."""
        if self._move_cost is not None:
            cost = self._move_cost
        elif hasattr(self.backend, "move_cost_estimate"):
            cost = self.backend.move_cost_estimate()
        else:
            cost = self._compile_seconds()
        move_costs = dict(self.backend.move_costs()) if hasattr(self.backend, "move_costs") else {}
        move_costs.update(self._measured_move_costs)
        return cost, move_costs

    def _ers_economics(self, tokens: int, step_time: float) -> ers.MoveEconomics:
        """What a move would cost and buy, from measurements: the roles' busy seconds in the last step; the moves'
        costs (`_move_costs`); the trainer's scaling (`_train_scaling`, re-measured on the first step after a move
        that changed the trainer); the rollout's own scaling when the backend can tell it; and the coupling of
        production to the trainer: the share of the step the staleness bound held admission, over eta + 1."""
        now = self.clock()
        held = self._held_by_staleness_s + (now - self._held_since if self._held_since is not None else 0.0)
        held, self._held_mark = held - self._held_mark, held
        coupling = ers.train_coupling(held, max(step_time, 0.0), self.cfg.staleness.eta)
        rollout_scaling = self.backend.rollout_scaling() if hasattr(self.backend, "rollout_scaling") else None
        rollout_busy = self.metrics.busy_s["rollout"] - self._rollout_busy_mark
        ref_busy = self.metrics.busy_s["ref"] - self._ref_busy_mark
        self._rollout_busy_mark, self._ref_busy_mark = self.metrics.busy_s["rollout"], self.metrics.busy_s["ref"]
        probe, train_busy = self._scaling_probe, self._timings["train_busy"]
        if probe is not None:  # the first step on the new layout: measure what the move did
            self._scaling_probe = None
            self._move_cost = probe["seconds"] + self._compile_seconds() - probe["compiled"]
            self._measured_move_costs[probe["move"]] = self._move_cost
            actor_busy = self._timings.get("actor_busy", train_busy)
            if tokens > 0 and probe["per_token"] > 0 and actor_busy > 0:
                ratio = (actor_busy / tokens) / probe["per_token"]
                self.ers_scaling = ers.measured_scaling(probe["groups"], self.pool.num_groups("train"),
                                                        ratio, prior=self.ers_scaling)
                log.info("ERS: trainer time per token x%.2f on %d -> %d groups: scaling %.2f of linear; "
                         "the move cost %.1fs", ratio, probe["groups"], self.pool.num_groups("train"),
                         self.ers_scaling, self._move_cost)
        cost, move_costs = self._move_costs()
        produced, self._produced_mark = self._produced - self._produced_mark, self._produced
        return ers.MoveEconomics(train_busy_s=train_busy, rollout_busy_s=rollout_busy, move_cost_s=cost,
                                 horizon_steps=self.cfg.steps - self.step, scaling=self._train_scaling(),
                                 ref_busy_s=ref_busy, rollout_scaling=rollout_scaling, train_coupling=coupling,
                                 produced_batches=produced / self.cfg.batch_samples, move_costs=move_costs)

    async def _ers_boundary(self, waited: float, step_time: float, ras: int, hol: float, tokens: int,
                            ready_volume: int):
        if self.cfg.mode != "tiderl" or not self.cfg.ers:
            return
        economics = self.ers_economics = self._ers_economics(tokens, step_time)
        signals = ers.ERSSignals(
            ready_volume=ready_volume, ideal_batch=self.run_cfg.batch_samples,
            trainer_idle_s=waited, hol_latency_s=hol, step_time_s=step_time, ras=ras,
            break_even_ras=math.inf, rollout_groups=self.pool.num_groups("rollout"),
            train_groups=self.pool.num_groups("train"), ref_groups=self.pool.num_groups("ref"),
            ref_idle=self.ra2p_mode == ra2p.COLOCATED)
        move, self.ers_history = await self._decided("ERS", lambda: ers.decide(
            signals, self.ers_history, ers.ERSConfig(patience=self.cfg.ers_patience, cooldown=self.cfg.ers_cooldown),
            economics if self.cfg.ers_economics else None))
        if self.ers_history.refused:
            self.ers_refused += 1
            self.ers_refusals[self.ers_history.refused_kind] += 1
            log.info("ERS: no move (%s)", self.ers_history.refused)
        if move is None:
            return
        await self._apply_move(move, tokens, "ERS")

    async def _apply_move(self, move: ers.Move, tokens: int, by: str) -> None:
        """One device group changes role (an ERS or RA2P move); the next step measures what it did."""
        t0, compiled = self.clock(), self._compile_seconds()
        groups_before = self.pool.num_groups("train")
        with self.metrics.span("train", "move"):
            await self.backend.move(move.from_role, move.to_role)
        for lane in ("rollout", "ref", "train"):
            self.metrics.set_devices(lane, len(self.pool.devices_of(lane)))
        self.ra2p_mode = move.ra2p_mode
        seconds = self.clock() - t0
        actor_busy = self._timings.get("actor_busy", self._timings["train_busy"])
        self._scaling_probe = dict(groups=groups_before, seconds=seconds, compiled=compiled,
                                   move=(move.from_role, move.to_role),
                                   per_token=actor_busy / max(tokens, 1))
        self._timings.update(t_act=None, t_ref_col=None)  # measured again on the new meshes
        if "ref" in (move.from_role, move.to_role):
            self._timings["t_ref_dec"] = None
        record = dict(step=self.step, frm=move.from_role, to=move.to_role, reason=move.reason, by=by,
                      seconds=seconds, predicted_gain_s=move.gain_s, predicted_cost_s=move.cost_s)
        self.moves.append(record)
        self._last_move = (self.step, move.to_role)
        log.info("%s: moved one device group %s -> %s (%s; predicted gain %s for cost %s) in %.2fs", by,
                 move.from_role, move.to_role, move.reason, move.gain_s, move.cost_s, seconds)

    async def _ra2p_boundary(self, ras: int, step_time: float, tokens: int) -> None:
        """RA2P's devices (`ra2p.repartition`, `ra2p.decide_repartition`): a reference group joins the actor when
        colocated on more devices beats the reference apart, and one is carved out of the actor's (up to the config's
        `ref_groups`) when decoupling pays; with ERS's patience, cooldown, noise floor and move costs."""
        if self.cfg.mode != "tiderl" or self.pool is None or self._moved_this_boundary():
            self.ra2p_history = ra2p.RepartitionHistory()
            return
        move, self.ra2p_history = await self._decided("RA2P devices",
                                                      lambda: self._ra2p_repartition(ras, step_time))
        if move is not None:
            await self._apply_move(ers.Move(move.from_role, move.to_role, move.mode, move.reason, move.gain_s,
                                            move.cost_s), tokens, "RA2P")

    def _ra2p_repartition(self, ras: int, step_time: float):
        """RA2P's device move at this boundary and its history (`_ra2p_boundary`)."""
        signals = self._ra2p_signals(ras)
        if signals is None:
            return None, self.ra2p_history
        f = self.pool.num_groups("ref")
        p = ra2p.repartition(signals, self.pool.num_groups("train"), f, self.cfg.ref_groups, self._train_scaling())
        default, per_move = self._move_costs()
        last_step, last_to = self._last_move
        return ra2p.decide_repartition(
            p, self.ra2p_history, ref_groups=f, mode_now=self.ra2p_mode, step_time_s=step_time,
            horizon_steps=self.cfg.steps - self.step,
            cost_s=per_move.get((p.from_role, p.to_role), default) if p is not None else default,
            min_gain_fraction=ers.ERSConfig().min_gain_fraction, patience=self.cfg.ers_patience,
            cooldown=self.cfg.ers_cooldown, last_move_to=last_to,
            boundaries_since_move=None if last_to is None else self.step - last_step)

    def _moved_this_boundary(self) -> bool:
        return self._last_move[0] == self.step

    def _ers_log(self) -> dict:
        """ERS's economics at the last boundary, for the step log (tiderl)."""
        e = self.ers_economics
        return {} if e is None else dict(
            ers_train_coupling=e.train_coupling, ers_scaling=e.scaling,
            ers_rollout_scaling=float("nan") if e.rollout_scaling is None else e.rollout_scaling)
