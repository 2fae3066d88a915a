"""Belayer recovery: a warm standby vs a cold engine start, and environment restore vs redo from turn 0.

    python benchmarks/recovery.py [--quick] [--json out.json] [--compile-cache]

Scenarios (docs/mechanisms.md, Belayer; `tiderl_jax/faults/`), each a JSON row with `scenario`, `recovery_s`,
`baseline_s`, `speedup` (= baseline_s / recovery_s) and `tasks_lost` (must be 0):

- `engine`: generations run in an engine worker process (`EngineClient`); once every generation
  has tokens, the worker is SIGKILLed. Recovery is measured from the failure being declared (the
  client sees the process exit) to the first tokens from the new worker: with a warm standby
  (promotion: weights already loaded, programs compiled) vs without one (a cold start: process
  start, JAX import, weight load from the parameter service, compile of every program). Workers run
  without the persistent compile cache unless `--compile-cache`, so the cold start compiles for
  real. In-flight generations continue from their token checkpoints in both; `tasks_lost` counts
  generations that did not finish or whose greedy tokens differ between the two runs.
- `environment`: multi-turn calculator and lookup episodes in environment subprocesses
  (`CheckpointingEnv`) with a scripted model (a malformed call, an early answer, an unknown tool,
  then the demonstration: 5-6 turns) whose turns take `GEN_S` of simulated generation, and a tool
  latency; each episode's subprocess is SIGKILLed before a seeded random turn >= 2. Recovery is
  the time from the kill until the episode is back at the turn it was at: with Belayer checkpoints
  (`p_fail` 0.1; each snapshot overlaps the next generation, so the rule takes them) vs without
  (restart, reset, redo every turn from turn 0). `tasks_lost` counts episodes that did not end with
  the unfaulted run's observations and reward.

- `overhead`: the controller (async mode, the tiny model, built-in calculator tasks, environment
  latency log-normal median 0.3 s) with fault tolerance off vs on (environments in checkpointed
  subprocesses and the engine in a worker process with a warm standby), no faults; pairs of runs
  interleaved (off, environments only, all; `--rounds`, default 3, the environment forkserver started before
  them, as a deployment starts it once). `recovery_s` is the median seconds per
  update with fault tolerance on, `baseline_s` without; `speedup` = baseline / recovery (target
  >= 0.97: within 3%); row `overhead` has everything on, `overhead_env` only the environment
  subprocesses (on this CPU the engine worker, a separate process on one device, runs beside the
  trainer instead of sharing its process and a 4-device fake mesh, which is faster by itself);
  extra keys `goodput_off` / `goodput_on` (tokens/s); `tasks_lost` counts samples the ledger does
  not account for.
"""

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(devices=8)

from tiderl_jax.agents import tasks as T  # noqa: E402
from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.engine.engine import EngineConfig  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.faults.engine_worker import EngineClient, ParamService, WorkerSpec  # noqa: E402
from tiderl_jax.agents.env import EnvRewound  # noqa: E402
from tiderl_jax.faults.env_recovery import CheckpointConfig, CheckpointingEnv  # noqa: E402
from tiderl_jax.model import chat  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402

TINY = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=2048)
SMALL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
ENGINE = EngineConfig(page_size=16, num_pages=256, max_seq_len=512, max_running=16, prefill_chunk=128,
                      max_prefill_rows=4, prefill_budget=256, decode_steps=8)  # 62 programs
ENGINE_QUICK = EngineConfig(page_size=8, num_pages=64, max_seq_len=128, max_running=8, prefill_chunk=32,
                            max_prefill_rows=2, prefill_budget=64, decode_steps=4)  # 17 programs
GEN_S = 0.2  # simulated generation time of one model turn (environment scenario)
TOOL_LATENCY = LatencyModel(median_s=0.15, sigma=0.5, max_s=1.0)


# ----------------------------------------------------------------------------------- engine


def _engine_run(spec, service, prompts, sampling, standby):
    """Generations with one SIGKILL of the worker mid-way; returns (recovery_s, outputs, event)."""
    client = EngineClient(spec, service, standby=standby)
    try:
        if standby:
            client.wait_standby(1800)
        rids = [client.submit(p, sampling) for p in prompts]
        deadline = time.monotonic() + 600
        while not all(client.checkpoint(r).tokens for r in rids):
            if time.monotonic() > deadline:
                raise TimeoutError("generations did not start")
            time.sleep(0.005)
        os.kill(client.primary.pid, signal.SIGKILL)
        outputs = []
        for r in rids:
            try:
                outputs.append(client.wait(r, 1800))
            except (TimeoutError, ValueError) as e:
                print(f"  generation {r} lost: {e}", flush=True)
                outputs.append(None)
    finally:
        client.close()
    event = client.failovers[0]
    return event.first_token_at - event.detected_at, outputs, event


def engine_scenario(quick: bool, compile_cache: bool) -> dict:
    cfg, engine = (SMALL, ENGINE_QUICK) if quick else (TINY, ENGINE)
    env = {} if compile_cache else {"JAX_ENABLE_COMPILATION_CACHE": "false"}
    # decode_steps tokens per step plus a short pause per step: every generation is mid-way at the kill
    spec = WorkerSpec(cfg, engine, step_delay_s=0.02, env=env)
    service = ParamService(init_decoder(cfg, seed=0), version=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(8, 40))] for _ in range(8)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=64 if quick else 128)
    warm_s, warm_out, warm_event = _engine_run(spec, service, prompts, sampling, standby=True)
    print(f"[engine] standby promotion: first tokens {warm_s:.3f}s after the failure was declared "
          f"({warm_event.resumed} generations resumed from token checkpoints)", flush=True)
    cold_s, cold_out, _ = _engine_run(spec, service, prompts, sampling, standby=False)
    print(f"[engine] cold start: first tokens {cold_s:.3f}s after the failure was declared", flush=True)
    lost = sum(a is None or b is None or a.tokens != b.tokens for a, b in zip(warm_out, cold_out))
    return {"scenario": "engine", "recovery_s": warm_s, "baseline_s": cold_s, "speedup": cold_s / warm_s,
            "tasks_lost": lost, "resumed_generations": warm_event.resumed,
            "promoted_standby": warm_event.promoted_standby, "compile_cache": compile_cache,
            "model": f"hidden {cfg.hidden_size}, {cfg.num_layers} layers"}


# ----------------------------------------------------------------------------------- environment


def _script(task):
    demo = [chat.render([m])[len(f"{chat.TURN_START}assistant\n"):]
            for m in T.demonstration(task) if m.role == "assistant"]
    return (["<tool_call>{not json</tool_call>", "It is 7.",
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'] + demo)


async def _episode(env, task, turns, kill_at=None):
    """One episode with simulated generation; returns (observations, reward, recovery_s)."""
    history = [await env.reset(task)]
    turn, killed_at, back_at, failed_turn = 0, None, None, None
    while True:
        await asyncio.sleep(GEN_S)  # the model generates its turn (a snapshot overlaps this)
        if turn == kill_at and killed_at is None:
            killed_at, failed_turn = time.perf_counter(), turn
            os.kill(env.worker.pid, signal.SIGKILL)
        try:
            result = await env.step(turns[turn])
        except EnvRewound as rw:
            history, turn = history[:rw.turn + 1], rw.turn
            continue
        turn += 1
        history.append(result.observation)
        if failed_turn is not None and back_at is None and turn > failed_turn:
            back_at = time.perf_counter()  # the failed turn's step is done again
        if result.done:
            return history, result.reward, (back_at - killed_at) if killed_at else 0.0


def environment_scenario(quick: bool) -> dict:
    n = 4 if quick else 12
    make = functools.partial(T.make_env, latency=TOOL_LATENCY, seed=0)
    episodes = [T.make_task("calculator" if i % 2 == 0 else "lookup", i // 2) for i in range(n)]
    rng = random.Random(0)
    kills = [rng.randint(2, len(_script(t)) - 1) for t in episodes]
    totals, lost = {}, 0
    for name, config in (("checkpoint", CheckpointConfig(mode="belayer", p_fail=0.1)),
                         ("redo", CheckpointConfig(mode="never"))):
        total = 0.0
        for task, kill_at in zip(episodes, kills):
            turns = _script(task)
            want = _run(make, config, task, turns, None)[:2] if name == "checkpoint" else None
            env = CheckpointingEnv(make, config)
            try:
                history, reward, recovery = asyncio.run(_episode(env, task, turns, kill_at))
            finally:
                env.close()
            if want is not None and (history, reward) != want:
                lost += 1
            total += recovery
            print(f"[environment/{name}] {task.task_id}: killed before turn {kill_at}, back after "
                  f"{recovery:.3f}s (checkpoints {env.stats['checkpoints']}, restores "
                  f"{env.stats['restores']}, redos {env.stats['redos']})", flush=True)
        totals[name] = total / n
    return {"scenario": "environment", "recovery_s": totals["checkpoint"], "baseline_s": totals["redo"],
            "speedup": totals["redo"] / totals["checkpoint"], "tasks_lost": lost, "episodes": n,
            "gen_s_per_turn": GEN_S, "tool_latency_median_s": TOOL_LATENCY.median_s}


def _run(make, config, task, turns, kill_at):
    env = CheckpointingEnv(make, config)
    try:
        return asyncio.run(_episode(env, task, turns, kill_at))
    finally:
        env.close()


def _controller_run(ft: str, steps: int, skip: int, logdir: str) -> tuple[float, float, int]:
    """(seconds per update, goodput tokens/s over updates skip+1..steps, samples unaccounted for)."""
    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.model.tokenizer import Tokenizer
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller import Controller, ControllerConfig
    cfg = ControllerConfig(mode="async", steps=steps, groups_per_step=4, group_size=4, max_concurrent=32,
                           task_kinds=("calculator",), device_group_size=2, rollout_groups=2, ref_groups=0,
                           train_groups=2, env_workers=ft in ("env", "all"), engine_workers=ft == "all")
    c = Controller(init_decoder(SMALL, seed=0), Tokenizer.builtin(), config=cfg, engine_config=ENGINE,
                   rollout_config=RolloutConfig(max_turns=4, max_new_tokens=24, max_context=512),
                   trainer_config=TrainerConfig(learning_rate=1e-4, warmup_steps=0, total_steps=steps + 1,
                                                row_len=512, micro_rows=4),
                   latency=LatencyModel(0.3, 1.0, 5.0), logdir=logdir, checkpoints=False)
    summary = asyncio.run(c.run())
    c.metrics.close()
    rows = [json.loads(x) for x in open(os.path.join(logdir, "metrics.jsonl"))]
    a, b = rows[skip - 1], rows[-1]
    span = b["wall_s"] - a["wall_s"]
    ledger = summary["ledger"]
    ended = ledger.get("completed", 0) + sum(v for k, v in ledger.items()
                                             if k.startswith("dropped:") and k != "dropped:stale")
    return span / (steps - skip), (b["consumed_tokens"] - a["consumed_tokens"]) / span, \
        ledger["admitted"] - ended - c.unfinished()


def overhead_scenario(quick: bool, rounds: int = 3, env_only: bool = False, steps: int = 8) -> list[dict]:
    """Two rows: `overhead` (environments in checkpointed subprocesses and the engine in a worker
    with a standby) and `overhead_env` (only the environments), each against fault tolerance off."""
    import statistics
    import tempfile
    steps, skip, pairs = (4, 1, 1) if quick else (steps, 2, rounds)
    from tiderl_jax.faults.env_worker import EnvWorker
    EnvWorker().close()  # starts the forkserver (once per run of the system), outside the measurement
    runs = {"off": [], "env": []} if env_only else {"off": [], "env": [], "all": []}
    lost = {"off": 0, "env": 0, "all": 0}
    for i in range(pairs):
        for ft in runs:
            step_s, goodput, unaccounted = _controller_run(ft, steps, skip, tempfile.mkdtemp(prefix="ovh_"))
            runs[ft].append((step_s, goodput))
            lost[ft] += unaccounted
            print(f"[overhead] round {i} fault tolerance {ft}: {step_s:.2f} s/update, {goodput:.1f} tok/s",
                  flush=True)
    base = statistics.median(x[0] for x in runs["off"])
    rows = []
    for ft, name in (("all", "overhead"), ("env", "overhead_env")):
        if ft not in runs:
            continue
        rec = statistics.median(x[0] for x in runs[ft])
        rows.append(dict(scenario=name, recovery_s=rec, baseline_s=base, speedup=base / rec,
                         tasks_lost=lost[ft] + lost["off"],
                         goodput_on=statistics.median(x[1] for x in runs[ft]),
                         goodput_off=statistics.median(x[1] for x in runs["off"])))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--compile-cache", action="store_true",
                   help="let workers use the persistent compile cache (a warm cold start)")
    p.add_argument("--only", choices=("engine", "environment", "overhead"))
    p.add_argument("--rounds", type=int, default=3, help="overhead: interleaved rounds of off / env / all")
    p.add_argument("--env-only", action="store_true", help="overhead: only the overhead_env row (off / env rounds)")
    p.add_argument("--steps", type=int, default=8, help="overhead: updates per run (the first 2 are not timed)")
    args = p.parse_args()
    rows = []
    if args.only in (None, "environment"):
        rows.append(environment_scenario(args.quick))
    if args.only in (None, "engine"):
        rows.append(engine_scenario(args.quick, args.compile_cache))
    if args.only in (None, "overhead"):
        rows += overhead_scenario(args.quick, args.rounds, args.env_only, args.steps)
    print(f"\n{'scenario':<13}{'recovery_s':>12}{'baseline_s':>12}{'speedup':>9}{'tasks_lost':>12}")
    for r in rows:
        print(f"{r['scenario']:<13}{r['recovery_s']:>12.3f}{r['baseline_s']:>12.3f}{r['speedup']:>8.1f}x"
              f"{r['tasks_lost']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
