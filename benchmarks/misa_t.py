"""Router policies of the rollout service on a mixed RLVR / RLHF / agentic trace, compared in one run.

    python benchmarks/misa_t.py [--quick] [--json out.json] [--replicas 4] [--regimes short,long] [--no-sim]

Real engines: `--replicas` (default 4) engine replicas of the tiny CPU model (random weights; benchmarks/ctb.py's
dimensions), each on its own faked device, behind `serving.RolloutService`; the real rollout loop
(`agents.rollout.RolloutRunner`, CTB mode: KV pinned across tool gaps, evicted under pressure) drives them.
Each replica's KV pool holds about one GRPO group's agentic sessions at their final contexts, so the agentic
sessions can overfill it.

Trace (seeded, the same for every policy): GRPO groups of 4 samples sharing their prompt, classes in the MISA-T
paper's mixture agentic / RLVR / RLHF = 48.6 / 33.1 / 18.2 (`data.mixture`), each class a replay environment
(the replies do not matter; the environment answers every turn): agentic sessions run 4 turns of 24 new tokens,
a 64-character observation after each tool gap (log-normal, median 0.3 s); RLVR and RLHF one turn. Two regimes
(`REGIMES`), which differ in what a recomputed context costs against a decode step:
- `short`: agentic prompts of 240 characters (contexts ~600 tokens), RLVR 80 -> 160 tokens, RLHF 48 -> 64; 80
  pages of 16 per replica. Recomputing a context costs a few decode steps on this CPU, so thrashing KV is cheap
  and bigger decode batches are what pays.
- `long`: agentic prompts of 2,048 characters (contexts ~2,400 tokens), RLVR 128 -> 256, RLHF 64 -> 96; 256
  pages of 16 per replica. Recomputing an agentic context costs ~0.3-0.5 s, about 100 decode steps: the regime of
  the papers (long contexts on large models, where a recompute costs seconds of an accelerator).
Offered load (as the simulator study's): a closed loop keeps `load` sessions offered at once (running, in a tool
gap, or held by the router); when one ends the next of the trace is offered.

Policies: round_robin, least_loaded, cache_aware (its fixed per-replica concurrency limit swept; the best kept
per load as `cache_aware_best`, the sweep reported), war (its per-request KV footprint: MISA-T's prior session
length, as in the simulator's study; its window at most the engine's `max_running`), misa_t (priors of the
trace's classes' KV footprints).
The runner's own CTB admission budget is set out of the way (1e9 tokens), so the router is the admission point.

Per policy and load: completed samples per second (the trace's samples / its makespan), prefix-cache hit rate
(prompt tokens found cached / prompt tokens), mixture deviation (`0.5 * sum_b |target_b - share_b|` of each
consecutive batch of 16 completed samples, in completion order: what a trainer consuming them sees; averaged
over the batches), p95 session latency (offered to ended, hold time included).

Simulated (unless `--no-sim`): the same comparison at the paper's scale, `tiderl_jax.sim.routing_study` (4
replicas of a 30B-class model at TP 4 on 16 simulated H100s), printed beside the paper's numbers.

JSON rows: setting (real / simulated), regime (real rows), policy, load, samples_per_s, kv_hit_rate, mixture_deviation,
p95_latency_s (+ cache_aware_limit, completed, prefilled_tokens, evictions, preemptions, held, wall_s).
"""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(devices=8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl_jax.agents.env import LatencyModel, StepResult, Task  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner  # noqa: E402
from tiderl_jax.data import mixture  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.policies import misa_t, routing  # noqa: E402
from tiderl_jax.runtime.devices import model_on  # noqa: E402
from tiderl_jax.serving.service import RolloutService, ServiceConfig  # noqa: E402

TINY = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=2048)
GROUP, BATCH, PAGE = 4, 16, 16
TARGET = mixture.parse_mixture(misa_t.PAPER_TARGET)
OBS_CHARS, GAP = 64, LatencyModel(median_s=0.3, sigma=0.5, max_s=2.0)
SYSTEM = "You are a helpful assistant."


@dataclasses.dataclass(frozen=True)
class Regime:
    """A trace's class shapes (class -> (prompt characters, turns, new tokens per turn)) and the replicas' engine."""
    name: str
    classes: dict
    engine: EngineConfig
    about: str


REGIMES = {r.name: r for r in (
    Regime("short", {"agentic": (240, 4, 24), "rlvr": (80, 1, 160), "rlhf": (48, 1, 64)},
           EngineConfig(page_size=PAGE, num_pages=80, max_seq_len=1024, max_running=16, prefill_chunk=256,
                        decode_steps=4),
           "agentic contexts of ~600 tokens, 1,280 KV tokens per replica: a recomputed context costs a few decode "
           "steps"),
    Regime("long", {"agentic": (2048, 4, 24), "rlvr": (128, 1, 256), "rlhf": (64, 1, 96)},
           EngineConfig(page_size=PAGE, num_pages=257, max_seq_len=4096, max_running=16, prefill_chunk=256,
                        decode_steps=4),
           "agentic contexts of ~2,400 tokens, 4,096 KV tokens per replica (one GRPO group's agentic sessions): a "
           "recomputed context costs ~100 decode steps, the papers' regime"),
)}


class ReplayEnvironment:
    """A replayed class of the trace: the user's prompt, then an observation after each turn until the class's
    last turn (after its tool gap for agentic sessions); reward 1 at the end."""

    def __init__(self, task: Task):
        self.task, self.turn = task, 0
        self.rng = random.Random(task.task_id)

    async def reset(self, task: Task) -> str:
        return task.prompt

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.task.data["max_turns"]:
            return StepResult(None, 1.0, True, {})
        await asyncio.sleep(GAP.sample(self.rng))
        return StepResult(("tool says " + "x" * OBS_CHARS)[:OBS_CHARS], 0.0, False, {"tool_calls": 1})


def _prompt(rng: random.Random, chars: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(chars))


def trace(regime: Regime, groups: int, seed: int = 0) -> list[Task]:
    """One task per group (its samples share it), classes in the target mixture's order."""
    def stream(cls):
        chars, turns, new = regime.classes[cls]
        return mixture.ClassSpec(
            lambda j, cls=cls: Task(f"{cls}-{j}", cls, _prompt(random.Random(f"{seed}/{cls}/{j}"), chars), "",
                                    {"system_prompt": SYSTEM}), max_turns=turns, max_new_tokens=new)
    mixed = mixture.MixedTasks({c: stream(c) for c in regime.classes}, TARGET)
    return [mixed(i) for i in range(groups)]


def router_config(regime: Regime, limit=None) -> routing.RouterConfig:
    kv = {c: 40 + chars + turns * new + (turns - 1) * (OBS_CHARS + 12)
          for c, (chars, turns, new) in regime.classes.items()}
    res = {"agentic": 4.0, "rlvr": 2.0, "rlhf": 1.0}  # rough seconds at this scale (priors; learnt as sessions end)
    mconf = misa_t.MISATConfig(target=dict(TARGET), prior_kv_tokens=kv, prior_residency_s=res)
    # WAR's per-request footprint: MISA-T's prior session length (the target-weighted mean of the classes'), as in
    # the simulator's study (sim/routing_study.py), so both size their KV accounting from the same number
    return routing.RouterConfig(concurrency_limit=limit, war_max_batch=regime.engine.max_running, misa_t=mconf,
                                war_footprint_tokens=misa_t.session_tokens(misa_t.MISATState(), mconf))


def run_one(engines, regime: Regime, tasks, load: int, policy: str, limit=None) -> dict:
    """The trace's sessions through a fresh service over `engines`, `load` of them offered at once (closed loop:
    when one ends, the next of the trace is offered)."""
    tok = Tokenizer.builtin()
    for e in engines:
        e.pool.drop_cached()  # every run starts cold
    before = [e.stats() for e in engines]
    service = RolloutService(engines, ServiceConfig(policy=policy, router=router_config(regime, limit)))
    runner = RolloutRunner(service, tok, RolloutConfig(mode="ctb", max_turns=4, max_new_tokens=64,
                                                        max_context=regime.engine.max_seq_len,
                                                        temperature=1.0, kv_budget_tokens=10**9))
    done: list[tuple[float, str, float, str | None]] = []  # (finish time, class, latency, failure)
    slots = None

    async def session(task, g, sample):
        async with slots:
            t_in = time.perf_counter()
            traj = await runner.submit(task, g, expected_group_size=GROUP, sample=sample)
            t_out = time.perf_counter()
        done.append((t_out - t0, task.data["workload_class"], t_out - t_in, traj.failure))

    async def main():
        nonlocal t0, slots
        slots = asyncio.Semaphore(load)
        await runner.start(ReplayEnvironment)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(session(t, g, s) for g, t in enumerate(tasks)
                                                    for s in range(GROUP))), 1800)
        finally:
            await runner.stop()
    t0 = 0.0
    asyncio.run(main())
    failed = [d for d in done if d[3]]
    if failed:
        raise RuntimeError(f"{policy}: {len(failed)} sessions failed, e.g. {failed[0][3]}")
    done.sort(key=lambda d: d[0])
    wall = done[-1][0]
    after = [e.stats() for e in engines]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before))
             for k in ("prompt_tokens", "prompt_tokens_cached", "prefill_tokens_computed", "evictions", "preemptions")}
    batches = [done[i:i + BATCH] for i in range(0, len(done) - BATCH + 1, BATCH)]
    dev = [misa_t.mixture_deviation(TARGET, {c: sum(d[1] == c for d in b) for c in regime.classes}) for b in batches]
    return dict(regime=regime.name, policy=policy, load=load, samples_per_s=len(done) / wall,
                kv_hit_rate=delta["prompt_tokens_cached"] / max(1, delta["prompt_tokens"]),
                mixture_deviation=float(np.mean(dev)) if dev else 0.0,
                p95_latency_s=float(np.percentile([d[2] for d in done], 95)), completed=len(done),
                prefilled_tokens=delta["prefill_tokens_computed"], evictions=delta["evictions"],
                preemptions=delta["preemptions"], wall_s=wall, held=service.counters["held"],
                moved=service.counters["moved"])


def simulated(quick: bool) -> list[dict]:
    """The same comparison in the simulator at the paper's scale (`sim.routing_study`), with its headline."""
    from tiderl_jax.sim import routing_study

    rows = routing_study.compare(quick=quick)
    print("\nsimulator (sim/routing_study.py: 4 replicas of a 30B-class model at TP 4 on 16 simulated H100, the "
          "paper's trace shapes and mixture; load = sessions offered at once)")
    _table(rows, ("load", "policy", "cache_aware_limit", "samples_per_s", "kv_hit_rate", "mixture_deviation",
                  "p95_latency_s"))
    h = routing_study.headline(rows)
    print(f"heaviest load {h['load']}: misa_t / best cache_aware = {h['misa_t_over_cache_aware']:.2f}x (paper: "
          f"+43.6% / +53.3%), hit {h['kv_hit_rate'][0]:.3f} -> {h['kv_hit_rate'][1]:.3f} (paper 0.745 -> 0.962), "
          f"deviation {100 * h['mixture_deviation'][0]:.1f} -> {100 * h['mixture_deviation'][1]:.1f} points (paper "
          f"4.14 -> 2.71); war / least_loaded = {h['war_over_least_loaded']:.2f}x (paper 1.4-1.6x)")
    return [dict(r, setting="simulated") for r in rows]


def _table(rows, cols) -> None:
    print("  ".join(f"{c:>17s}" for c in cols))
    for r in rows:
        print("  ".join(f"{r.get(c):>17.3f}" if isinstance(r.get(c), float) else f"{str(r.get(c)):>17s}"
                        for c in cols))


def real(regime: Regime, replicas: int, quick: bool) -> list[dict]:
    """Every policy at each load on `replicas` engine replicas in `regime`; cache_aware's limit swept."""
    groups = 12 if quick else 24
    loads = {"light": 4, "heavy": 48} if quick else {"light": 4, "medium": 16, "heavy": 64}
    limits = (4, 12) if quick else (2, 4, 8, 16)
    model = dataclasses.replace(TINY, max_position_embeddings=max(TINY.max_position_embeddings,
                                                                  regime.engine.max_seq_len))
    graphdef, params = nnx.split(init_decoder(model, seed=0))
    engines = [Engine(model_on(graphdef, params, make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, [d]),
                               DEFAULT_RULES), regime.engine) for d in jax.devices()[:replicas]]
    tasks = trace(regime, groups)
    print(f"\nregime {regime.name!r}: {regime.about}", flush=True)
    t = time.perf_counter()  # warm-up: the programs this trace asks for, compiled on every replica (not measured)
    run_one(engines, regime, tasks, max(loads.values()), "least_loaded")
    print(f"{replicas} replicas warmed up in {time.perf_counter() - t:.0f}s", flush=True)
    rows = []
    for load_name, load in loads.items():
        runs = [(pol, None) for pol in ("round_robin", "least_loaded", "war", "misa_t")]
        runs += [("cache_aware", lim) for lim in limits]
        for pol, lim in runs:
            r = run_one(engines, regime, tasks, load, pol, lim)
            r.update(load_name=load_name, cache_aware_limit=lim, setting="real")
            print(f"  {load_name:6s} {pol:12s} limit={lim}  {r['samples_per_s']:.2f} samples/s  "
                  f"hit {r['kv_hit_rate']:.3f}  dev {r['mixture_deviation']:.3f}  p95 {r['p95_latency_s']:.1f}s  "
                  f"evictions {r['evictions']}", flush=True)
            rows.append(r)
        sweep = [r for r in rows if r["load"] == load and r["policy"] == "cache_aware"]
        rows.append({**max(sweep, key=lambda r: r["samples_per_s"]), "policy": "cache_aware_best"})
    print(f"\nreal engines, regime {regime.name!r} ({replicas} replicas of the tiny model; load = sessions offered "
          "at once)")
    _table(rows, ("load", "policy", "cache_aware_limit", "samples_per_s", "kv_hit_rate", "mixture_deviation",
                  "p95_latency_s", "prefilled_tokens", "evictions", "preemptions", "held"))
    heavy = {r["policy"]: r for r in rows if r["load"] == max(loads.values())}
    m, c = heavy["misa_t"], heavy["cache_aware_best"]
    print(f"regime {regime.name!r}, heavy load: misa_t / best cache_aware samples/s = "
          f"{m['samples_per_s'] / c['samples_per_s']:.2f}x (target >= 1.4), hit {c['kv_hit_rate']:.3f} -> "
          f"{m['kv_hit_rate']:.3f}, deviation {c['mixture_deviation']:.3f} -> {m['mixture_deviation']:.3f}; "
          f"war / least_loaded = {heavy['war']['samples_per_s'] / heavy['least_loaded']['samples_per_s']:.2f}x "
          "(target >= 1.3)", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma list of {sorted(REGIMES)}")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's comparison at the paper's scale")
    args = p.parse_args()
    regimes = [r for r in args.regimes.split(",") if r]
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        p.error(f"unknown regimes {unknown}; choose from {sorted(REGIMES)}")
    rows = []
    for name in regimes:
        rows += real(REGIMES[name], args.replicas, args.quick)
    if not args.no_sim:
        rows += simulated(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
