"""benchmarks/sim_validation.py's calibration lab: the goodput model's engine, trainer, ref scorer and weight sync
measured on this CPU's faked devices (`_Lab`, one round of every measurement `_round`), the rollout loop alone with
the real warm-started policy, and `calibrate`, which turns the fastest of interleaved rounds into `MeasuredCosts`
(`_simval_fit.fit`)."""

import argparse
import os
import sys
import threading
import time

from _env import setup

ROOT = setup(devices=8)

from _simval_fit import fit  # noqa: E402
from _simval_workload import (ENGINE, GROUP_SIZE, GROUPS, KINDS, LAYOUTS, LONG, MODEL, MODES,  # noqa: E402
                              OFFSETS, ROLLOUT_GROUPS, ROLLOUTS, TRAINER)

from tiderl_jax.agents import tasks as task_lib  # noqa: E402
from tiderl_jax.model import chat  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.sim import costs  # noqa: E402


def _timed(fn, reps: int) -> float:
    """Fastest of `reps` calls (after one untimed call: compiles, caches). The fastest, not the median:
    other processes on this shared machine only ever add time, and they come and go."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


class _Lab:
    """The goodput model's engine, trainer and scorer on meshes of n fake devices."""

    def __init__(self, shapes):
        import jax
        from flax import nnx

        from tiderl_jax.model.decoder import init_decoder
        from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh

        self.jax, self.nnx = jax, nnx
        self.devices = jax.devices()
        self.rules = DEFAULT_RULES
        self.make_mesh = make_mesh
        self.graphdef, self.params = nnx.split(init_decoder(MODEL, seed=0))
        self.shapes = shapes
        self.prompts = [r[3] for kind in KINDS for r in shapes[kind]]
        self._engines, self._trainers, self._scorers, self._warm = {}, {}, {}, set()

    def mesh(self, n: int, offset: int = 0):
        t = 2 if n % 2 == 0 else 1
        return self.make_mesh({"data": 1, "fsdp": n // t, "tensor": t}, self.devices[offset:offset + n])

    def engine(self, n: int):
        from tiderl_jax.engine.engine import Engine, EngineConfig
        from tiderl_jax.runtime.devices import model_on

        if n not in self._engines:
            cfg = EngineConfig(**ENGINE, enable_prefix_cache=False)
            self._engines[n] = Engine(model_on(self.graphdef, self.params, self.mesh(n), self.rules), cfg)
        return self._engines[n]

    def trainer(self, n: int, offset: int):
        from tiderl_jax.model.sharding import place_copy
        from tiderl_jax.rl.losses import LossConfig
        from tiderl_jax.rl.trainer import Trainer
        from tiderl_jax.rl.trainer_config import TrainerConfig
        from tiderl_jax.runtime.devices import model_on

        key = (n, offset)
        if key not in self._trainers:
            cfg = TrainerConfig(loss=LossConfig(), total_steps=1000, **TRAINER)
            tr = Trainer(model_on(self.graphdef, self.params, self.mesh(n, offset), self.rules), cfg,
                         mesh=self.mesh(n, offset), rules=self.rules)
            tr.ref_params = place_copy(tr.params, self.jax.tree.map(lambda x: x.sharding, tr.params))
            self._trainers[key] = tr
        return self._trainers[key]

    def batch(self, groups: int = GROUPS):
        """`groups` GRPO groups of demonstration trajectories (kinds in turn), rewards 0 / 1 mixed."""
        from tiderl_jax.rl import sft

        tok = Tokenizer.builtin()
        out = []
        for g in range(groups):
            task = task_lib.make_task(KINDS[g % len(KINDS)], g // len(KINDS), "train", 0)
            for i in range(GROUP_SIZE):
                t = sft.demonstration_trajectory(task, tok, group=g)
                t.reward = float(i % 2)
                t.versions = [0 if m else -1 for m in t.loss_mask]
                t.info["sample"] = i
                out.append(t)
        return out

    # -------------------------------------------------------------- rollout

    def _prompt(self, i: int, length: int = 0) -> list[int]:
        """Prompt i of the tasks, or `length` tokens of the prompts from i on (a long context)."""
        if not length:
            return self.prompts[i % len(self.prompts)]
        out = []
        while len(out) < length:
            out += self.prompts[i % len(self.prompts)]
            i += 1
        return out[:length]

    def _fill(self, eng, batch: int, new_tokens: int = 900, context: int = 0):
        """`batch` sequences decoding (prefills done), on the tasks' prompts or `context`-token ones."""
        from tiderl_jax.engine.engine import Request
        from tiderl_jax.engine.sampling import SamplingParams

        for h in list(eng._seqs):
            eng.abort(h)
            eng.release(h)
        for i in range(batch):
            eng.submit(Request(self._prompt(i, context), SamplingParams(seed=i, max_new_tokens=new_tokens)))
        for _ in range(50):
            eng.step()
            st = eng.stats()
            if st["num_waiting"] == 0 and st["num_prefilling"] == 0:
                break

    def decode_step(self, n: int, batch: int, reps: int, context: int = 0) -> tuple[float, int]:
        """(seconds of one decode step of `batch` sequences, 8 steps per call; their context tokens then)."""
        eng = self.engine(n)
        self._fill(eng, batch, context=context)
        tokens = sum(len(q.tokens) for q in eng._seqs.values()) + batch * ENGINE["decode_steps"] // 2
        return _timed(eng.step, reps) / ENGINE["decode_steps"], tokens

    def prefill_cached(self, n: int, running: int, rows: int, cached: int, new: int, reps: int) -> tuple[float, float]:
        """(seconds of the prefill calls of an engine step that resumes `rows` sequences holding `cached`
        tokens of KV with `new` tokens each, next to `running` decoding; the attention pairs computed:
        rows * (new * cached + new * (new + 1) / 2))."""
        from tiderl_jax.engine.engine import Request
        from tiderl_jax.engine.sampling import SamplingParams

        eng = self.engine(n)
        ts = []
        for rep in range(reps + 1):
            self._fill(eng, running)
            eng.step()
            held = []
            for j in range(rows):
                text = self._prompt(7 * rep + j, cached + new)
                if not cached:
                    held.append((eng.submit(Request(text, SamplingParams(seed=100 + j, max_new_tokens=50))), None))
                    continue
                held.append((eng.submit(Request(text[:cached], SamplingParams(seed=100 + j, max_new_tokens=1),
                                                keep_kv=True)), text[cached:]))
            for _ in range(20 if cached else 0):
                eng.step()
                if all(eng.get(h).status.value == "paused" for h, _ in held):
                    break
            for h, text in held:
                if text is not None:
                    eng.resume(h, text, sampling=SamplingParams(seed=5, max_new_tokens=50))
            eng._admit()
            chunks = eng._plan_prefill()
            t0 = time.perf_counter()
            eng._run_prefill(chunks)
            if rep:  # the first compiled
                ts.append(time.perf_counter() - t0)
            for h, _ in held:
                eng.abort(h)
                eng.release(h)
        # (a resumed context holds its last sampled token too, prefilled with the new ones)
        c, k = (cached, new + 1) if cached else (0, new)
        return min(ts), rows * (k * c + k * (k + 1) / 2)

    def prefill(self, n: int, running: int, prompts: int, reps: int) -> tuple[float, int, float]:
        """(seconds of an engine step admitting `prompts` new prompts next to `running` decoding
        sequences, minus one decode step; their tokens; their attention pairs)."""
        from tiderl_jax.engine.engine import Request
        from tiderl_jax.engine.sampling import SamplingParams

        eng = self.engine(n)
        ts, tokens = [], 0
        for rep in range(reps + 1):
            self._fill(eng, running)
            eng.step()
            new = [self.prompts[(7 * rep + j) % len(self.prompts)] for j in range(prompts)]
            for j, p in enumerate(new):
                eng.submit(Request(p, SamplingParams(seed=100 + j, max_new_tokens=50)))
            t0 = time.perf_counter()
            eng.step()
            if rep:  # the first compiled
                ts.append(time.perf_counter() - t0)
                tokens = sum(len(p) for p in new)
                pairs = sum(len(p) * (len(p) + 1) / 2 for p in new)
        one, _ = self.decode_step(n, running + prompts, reps)
        return max(0.0, min(ts) - one), tokens, pairs

    # -------------------------------------------------------------- training

    def train(self, n: int, offset: int, reps: int) -> dict:
        tr = self.trainer(n, offset)
        trajs = self.batch()
        if (n, offset) not in self._warm:
            tr.rl_step(trajs)  # compiles
            self._warm.add((n, offset))
        outs = [tr.rl_step(trajs) for _ in range(reps)]
        tokens = sum(len(t.tokens) for t in trajs)
        med = {k: min(o[k] for o in outs) for k in ("time_proximal_s", "time_ref_s", "time_update_s")}
        return dict(med, tokens=tokens)

    def programs(self, n: int, offset: int, fresh: int = 1) -> dict:
        """Seconds a new Trainer on the train mesh of n devices (and a new Scorer on n ref devices) spends on
        its programs at their first call, as each mode of goodput.py builds its own and a new micro-batch
        count makes new ones (`Trainer._program`): a new one's first `rl_step` (`score_trajectories`) minus a
        warm one, per part: the proximal score program and the update program (the ref program); the fastest
        first call of `fresh` new ones minus the fastest warm call. Call after `jax.clear_caches()`: no program
        in memory, the persistent compile cache as it is (what `program_s` measures for the engine)."""
        from tiderl_jax.model.sharding import place_copy
        from tiderl_jax.rl.losses import LossConfig
        from tiderl_jax.rl.trainer import Scorer, Trainer
        from tiderl_jax.rl.trainer_config import TrainerConfig
        from tiderl_jax.runtime.devices import model_on

        cfg = TrainerConfig(loss=LossConfig(), total_steps=1000, **TRAINER)
        trajs, group = self.batch(), self.batch(1)
        first, warm = dict(score=[], update=[], ref=[]), dict(score=[], update=[], ref=[])
        for _ in range(fresh):
            mesh = self.mesh(n, offset)
            tr = Trainer(model_on(self.graphdef, self.params, mesh, self.rules), cfg, mesh=mesh, rules=self.rules)
            tr.ref_params = place_copy(tr.params, self.jax.tree.map(lambda x: x.sharding, tr.params))
            for i in range(3):  # (the colocated ref pass runs the score program the proximal pass loaded)
                out = tr.rl_step(trajs)
                (warm if i else first)["score"].append(out["time_proximal_s"])
                (warm if i else first)["update"].append(out["time_update_s"])
            sc = Scorer(model_on(self.graphdef, self.params, mesh, self.rules), cfg, mesh=mesh, rules=self.rules)
            for i in range(3):
                (warm if i else first)["ref"].append(_wall(lambda: sc.score_trajectories(group)))
        # (the fastest first call minus the fastest warm one: other processes only add time)
        return {k: max(0.0, min(first[k]) - min(warm[k])) for k in first}

    def ref_pass(self, n: int, offset: int, reps: int) -> tuple[float, int]:
        from tiderl_jax.rl.losses import LossConfig
        from tiderl_jax.rl.trainer import Scorer
        from tiderl_jax.rl.trainer_config import TrainerConfig
        from tiderl_jax.runtime.devices import model_on

        if (n, offset) not in self._scorers:
            mesh = self.mesh(n, offset)
            self._scorers[n, offset] = Scorer(model_on(self.graphdef, self.params, mesh, self.rules),
                                              TrainerConfig(loss=LossConfig(), total_steps=1000, **TRAINER),
                                              mesh=mesh, rules=self.rules)
        sc = self._scorers[n, offset]
        group = self.batch(1)
        return _timed(lambda: sc.score_trajectories(group), reps), sum(len(t.tokens) for t in group)

    def sync(self, n_roll: int, n_train: int, offset: int, reps: int) -> float:
        from tiderl_jax.model.sharding import place_copy

        eng, tr = self.engine(n_roll), self.trainer(n_train, offset)

        def publish():
            eng.update_params(place_copy(tr.params, eng.runner.param_shardings), eng.version + 1)
            self.jax.block_until_ready(eng.runner.params)
        return _timed(publish, reps)

    def overlap(self, train_devices: int, reps: int) -> tuple[float, float]:
        """Slowdowns when rollout (engine on devices 0-3, 12 sequences decoding) and training (trainer on
        the layout's train devices) run at once: both loop together for `reps` train steps; each one's
        time per step then over its time alone."""
        eng, tr = self.engine(4), self.trainer(train_devices, OFFSETS[train_devices])
        trajs = self.batch()
        self._fill(eng, 12)
        alone_dec = _timed(eng.step, reps * 3)
        tr.rl_step(trajs)
        alone_train = min(_wall(lambda: tr.rl_step(trajs)) for _ in range(reps))
        self._fill(eng, 12)
        stop, steps = threading.Event(), []

        def engine_loop():
            while not stop.is_set():
                steps.append(_wall(eng.step))
        th = threading.Thread(target=engine_loop, daemon=True)
        t0 = time.perf_counter()
        th.start()
        for _ in range(reps):
            tr.rl_step(trajs)
        both = time.perf_counter() - t0
        stop.set()
        th.join()
        # engine steps completed while training ran (rate), train steps in that time
        x_roll = both / max(1, len(steps)) / alone_dec
        x_train = both / reps / alone_train
        return max(1.0, x_roll), max(1.0, x_train)


    # -------------------------------------------------------------- the rollout loop alone

    def rollout(self, params, kv_mode: str, groups: int, in_flight: int, devices: int = 4, seed: int = 0) -> dict:
        """The real rollout loop alone: `RolloutRunner` (goodput.py's engine with its prefix cache, its
        rollout config) on a rollout mesh of `devices` with the policy `params`, no environment latency,
        `groups` GRPO groups of the controller's tasks with `in_flight` groups running at a time (the next
        starts when one ends, as the controller's capacity admits them). Returns the wall seconds, the
        engine calls the loop made (`calls`: (start, end, prefill calls, compile seconds, new programs, tokens
        decoded) each, timed inside the loop), the
        engine's counters, and every sample's shape (prompt, model tokens per turn, observation tokens
        between turns): what the real policy writes on these tasks."""
        import asyncio

        from tiderl_jax.agents.env import LatencyModel
        from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
        from tiderl_jax.engine.engine import Engine, EngineConfig
        from tiderl_jax.model.sharding import place_copy
        from tiderl_jax.runtime.devices import model_on

        key = ("rollout", kv_mode, devices)
        if key not in self._engines:
            self._engines[key] = Engine(model_on(self.graphdef, self.params, self.mesh(devices), self.rules),
                                        EngineConfig(**ENGINE))
        eng = self._engines[key]
        # a new version: the prefix cache of an earlier pass does not hit
        eng.update_params(place_copy(params, self.jax.tree.map(lambda x: x.sharding, eng.runner.params)),
                          eng.version + 1)
        runner = RolloutRunner(eng, Tokenizer.builtin(), RolloutConfig(
            seed=seed, mode=kv_mode, max_turns=8, max_new_tokens=96, max_context=1024))
        calls = []

        class _Span:
            def __enter__(self):
                self.c0, self.t0 = eng._counters["prefill_calls"], time.perf_counter()
                self.k0, self.p0, self.d0 = eng.compile_s, eng.runner.compile_count(), eng._counters["decode_tokens"]

            def __exit__(self, *exc):
                calls.append((self.t0, time.perf_counter(), eng._counters["prefill_calls"] - self.c0,
                              eng.compile_s - self.k0, eng.runner.compile_count() - self.p0,
                              eng._counters["decode_tokens"] - self.d0))
        runner.step_span = _Span
        c0, compile0, programs0 = dict(eng._counters), eng.compile_s, eng.runner.compile_count()

        async def main():
            await runner.start(task_lib.TaskEnvFactory(LatencyModel()))
            slots = asyncio.Semaphore(in_flight)

            async def group(g):
                async with slots:
                    task = task_lib.make_task(KINDS[g % len(KINDS)], g // len(KINDS), "train", 0)
                    return await asyncio.gather(*(runner.submit(task, g, expected_group_size=GROUP_SIZE, sample=i)
                                                  for i in range(GROUP_SIZE)))
            t0 = time.perf_counter()
            out = await asyncio.gather(*(group(g) for g in range(groups)))
            wall = time.perf_counter() - t0
            await runner.stop()
            return out, wall
        out, wall = asyncio.run(main())
        shapes, tok = [], Tokenizer.builtin()
        for trajs in out:
            rows = []
            for t in trajs:
                turns = t.turns
                if not turns:  # (a task that failed before its first turn)
                    continue
                # the tool calls of each turn followed by an environment step: each waits the environment's
                # latency (ToolEnvironment.step: a malformed turn, or one without a call, waits none)
                tools = []
                for u in turns[:-1]:
                    parsed = chat.parse_tool_calls(tok.decode(t.tokens[u.start:u.end]))
                    tools.append(0 if parsed.errors else len(parsed.tool_calls))
                rows.append((turns[0].start, tuple(u.end - u.start for u in turns),
                             tuple(b.start - a.end for a, b in zip(turns, turns[1:])), tuple(tools)))
            shapes.append(rows)
        c = {k: eng._counters[k] - c0[k] for k in c0}
        c["prefix_hit_rate"] = c["prompt_tokens_cached"] / max(1, c["prompt_tokens"])
        return dict(wall_s=wall, calls=calls, counters=c, shapes=shapes, compile_s=eng.compile_s - compile0,
                    programs=eng.runner.compile_count() - programs0)


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _round(lab: "_Lab") -> dict:
    """One measurement of every quantity (one timed call each)."""
    out = {}
    for n in sorted({LAYOUTS[m][0] for m in MODES}):
        out[f"decode_{n}_b4"], _ = lab.decode_step(n, 4, 1)
        out[f"decode_{n}_b16"], out[f"decode_{n}_b16_kv"] = lab.decode_step(n, 16, 1)
        # longer contexts (the attention terms): what later turns and re-prefilled contexts cost
        out[f"decode_{n}_b16_long"], out[f"decode_{n}_b16_long_kv"] = lab.decode_step(n, 16, 1, context=LONG)
        for k in (1, 4):
            t, tokens, pairs = lab.prefill(n, 8, k, 1)
            out.update({f"prefill_{n}_{k}": t, f"prefill_{n}_{k}_tokens": tokens, f"prefill_{n}_{k}_pairs": pairs})
        for c in (0, LONG):
            out[f"prefill_{n}_c{c}"], out[f"prefill_{n}_c{c}_pairs"] = lab.prefill_cached(n, 8, 4, c, 48, 1)
    for n in sorted({LAYOUTS[m][2] for m in MODES}):
        t = lab.train(n, OFFSETS[n], 1)
        out.update({f"train_{n}_{k}": v for k, v in t.items()})
    out["ref_2"], out["ref_2_tokens"] = lab.ref_pass(2, 4, 1)
    for roll, train in sorted({(LAYOUTS[m][0], LAYOUTS[m][2]) for m in MODES}):
        out[f"sync_{roll}_{train}"] = lab.sync(roll, train, OFFSETS[train], 1)
    return out


def _rollout_key(kv_mode: str, devices: int) -> str:
    return kv_mode if devices == 4 else f"{kv_mode}_{devices}"


def warm_params(path: str, log=print):
    """What each of goodput.py's modes starts from: `path` is an HF checkpoint of its model (goodput.py's default,
    the shipped checkpoints/tiny_agentic_sft) or a directory of goodput.py's cached SFT warm starts; None when
    neither is there (run `benchmarks/goodput.py --modes` once to make the cached one)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if os.path.exists(os.path.join(path, "config.json")):
        import goodput

        assert goodput.MODEL == MODEL, "benchmarks/goodput.py's model changed: update MODEL here"
        return goodput.warm_start(Tokenizer.builtin(), argparse.Namespace(warm_from=path))
    key = f"{MODEL.hidden_size}x{MODEL.num_layers}_{'-'.join(KINDS)}_500x32"
    if not os.path.isdir(os.path.join(path, key)):
        log(f"no warm start {key} in {path}: the rollout loop is not measured (demonstration shapes, no per-call "
            f"or program costs)")
        return None
    import goodput  # (its JAX stack is loaded by now)

    assert goodput.MODEL == MODEL, "benchmarks/goodput.py's model changed: update MODEL here"
    return goodput.warm_start(Tokenizer.builtin(), argparse.Namespace(
        tasks=list(KINDS), sft_steps=500, sft_batch=32, warm_cache=path, warm_from=""))


def calibrate(shapes, reps: int, log=print, warm_cache: str = "",
              draws: int = 4) -> tuple[dict[str, costs.MeasuredCosts], dict]:
    """`MeasuredCosts` per mode (from its layout), and the raw measurements. Every quantity is
    measured once per round, `reps` rounds interleaved, and its fastest value kept: the load of other
    processes drifts over minutes, and interleaving keeps the layouts' numbers comparable."""
    lab = _Lab(shapes)
    t_all = time.perf_counter()
    rounds = [_round(lab) for _ in range(reps)]
    raw = {k: min(r[k] for r in rounds) for k in rounds[0]}
    overlap = {n: lab.overlap(n, max(2, reps)) for n in sorted({LAYOUTS[m][2] for m in MODES if m != "sync"})}
    for n, (x_roll, x_train) in overlap.items():
        raw.update({f"overlap_{n}_rollout_x": x_roll, f"overlap_{n}_train_x": x_train})
    # the trainer's and scorer's program loads (each of goodput.py's modes builds its own): no program in memory
    lab.jax.clear_caches()
    for n in sorted({LAYOUTS[m][2] for m in MODES}):
        for k, v in lab.programs(n, OFFSETS[n], max(1, reps // 2)).items():
            raw[f"programs_{n}_{k}_s"] = v
    warm = warm_params(warm_cache, log) if warm_cache else None
    if warm is not None:
        # the rollout loop alone, as goodput.py's first mode on these devices finds it: no program in memory
        # (each is traced, lowered and loaded from the persistent cache, or compiled), then warm passes
        lab.jax.clear_caches()
        for kv, devices, in_flight in ROLLOUTS:
            first = lab.rollout(warm, kv, ROLLOUT_GROUPS, in_flight, devices)
            best = min((lab.rollout(warm, kv, ROLLOUT_GROUPS, in_flight, devices) for _ in range(max(1, reps // 2))),
                       key=lambda r: r["wall_s"])
            kv = _rollout_key(kv, devices)
            calls = best["calls"]
            raw.update({f"rollout_{kv}_first_wall_s": first["wall_s"],
                        f"rollout_{kv}_first_compile_s": first["compile_s"],
                        f"rollout_{kv}_first_programs": first["programs"], f"rollout_{kv}_wall_s": best["wall_s"],
                        f"rollout_{kv}_calls": len(calls), f"rollout_{kv}_prefill_calls": sum(c[2] for c in calls),
                        f"rollout_{kv}_busy_s": sum(c[1] - c[0] for c in calls),
                        f"rollout_{kv}_hit_rate": best["counters"]["prefix_hit_rate"],
                        f"rollout_{kv}_shapes": best["shapes"]})
            # more draws of the same policy's samples (other sampling seeds): the real runs sample each group under
            # the policy version of its time, a draw of its own (their samples per update differ; their lengths do
            # not drift: see the module docstring)
            raw[f"rollout_{kv}_shapes_more"] = [
                lab.rollout(warm, kv.split("_")[0], ROLLOUT_GROUPS, in_flight, devices, seed=s)["shapes"]
                for s in range(1, draws)]
            log(f"rollout loop alone ({kv}, {ROLLOUT_GROUPS} groups, {in_flight} at a time, no latency): "
                f"{best['wall_s']:.2f}s, {len(calls)} engine calls ({raw[f'rollout_{kv}_prefill_calls']} prefill) "
                f"busy {raw[f'rollout_{kv}_busy_s']:.2f}s, KV hit {raw[f'rollout_{kv}_hit_rate']:.3f}; first pass "
                f"{first['wall_s']:.2f}s with {first['compile_s']:.2f}s for {first['programs']} programs")
        raw["program_s"] = raw["rollout_request_first_compile_s"] / max(1, raw["rollout_request_first_programs"])
    raw["calibration_s"] = time.perf_counter() - t_all
    raw["train_micro"] = costs.packed_micro_batches([len(t.tokens) for t in lab.batch()], TRAINER["row_len"],
                                                    TRAINER["micro_rows"])
    raw["ref_2_micro"] = costs.packed_micro_batches([len(t.tokens) for t in lab.batch(1)], TRAINER["row_len"],
                                                    TRAINER["micro_rows"])
    return fit(raw, log, warm is not None), raw
