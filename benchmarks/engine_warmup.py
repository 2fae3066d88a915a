"""Cold start-up of the main job's rollout engine: programs compiled by `Engine.warmup()` and its seconds, with no
persistent compile cache, then traffic that must compile nothing more.

    python benchmarks/engine_warmup.py [--quick] [--json out.json] [--config configs/tiny_agentic.py]

The engine is the main job's (the config's `engine` section, the warm-started policy of its `checkpoint`) on its
rollout mesh (the config's `controller.device_group_size` x `rollout_groups` devices, `tensor`-way), as
`launch/train.py` builds it. The persistent cache is switched off so every program really compiles. After the
warm-up, a few agentic rollouts (the built-in tasks through the rollout loop) run and the engine's compile seconds
must not grow. Target: a cold warm-up under 60 s on this machine. `--quick` runs fewer rollouts.
JSON row: config, programs, warmup_s, programs_by_kind, compile_s_after_traffic, programs_outside_grid.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""  # cold: before _env sets the shared cache
from _env import setup  # noqa: E402

ROOT = setup(devices=8)

import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)

from flax import nnx  # noqa: E402

from tiderl_jax.agents import tasks  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.config import build_tokenizer, load_config_file, sharding_rules  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.hf_io import load_hf_checkpoint  # noqa: E402
from tiderl_jax.rl.evaluate import sample_groups  # noqa: E402
from tiderl_jax.runtime.devices import model_on  # noqa: E402
from tiderl_jax.runtime.pool import group_mesh  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--config", default="configs/tiny_agentic.py")
    args = ap.parse_args()
    c = load_config_file(os.path.join(ROOT, args.config))
    cc = c.controller
    model = load_hf_checkpoint(os.path.join(ROOT, c.checkpoint))
    graphdef, params = nnx.split(model)
    mesh = group_mesh(jax.devices()[:cc.device_group_size * cc.rollout_groups], cc.tensor)
    engine = Engine(model_on(graphdef, params, mesh, sharding_rules(c)), EngineConfig(**c.engine.to_dict()))
    kinds = {}
    for key in engine.grid():
        kinds[key[0]] = kinds.get(key[0], 0) + 1
    print(f"{args.config}: {engine.num_programs()} programs {kinds}, compiling cold ...", flush=True)
    seconds = engine.warmup()
    before = engine.compile_s
    n = 4 if args.quick else 16
    work = [tasks.make_task(("calculator", "lookup")[i % 2], i, "heldout", 0) for i in range(n)]
    sample_groups(engine, build_tokenizer(c), work, 2, RolloutConfig(max_turns=4, max_new_tokens=96, max_context=1024))
    row = dict(config=args.config, programs=engine.num_programs(), warmup_s=round(seconds, 1), programs_by_kind=kinds,
               compile_s_after_traffic=round(engine.compile_s - before, 3),
               programs_outside_grid=sorted(map(str, engine.programs() - set(engine.grid()))))
    print(f"{'config':28} {'programs':>8} {'warmup s':>9} {'compile s after traffic':>24}")
    print(f"{args.config:28} {row['programs']:>8} {row['warmup_s']:>9.1f} {row['compile_s_after_traffic']:>24.3f}")
    if row["programs_outside_grid"]:
        print("programs outside the grid:", row["programs_outside_grid"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row], f, indent=1)


if __name__ == "__main__":
    main()
