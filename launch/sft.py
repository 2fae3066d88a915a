"""The supervised warm start on its own: SFT from random weights on the tasks' demonstrations, written as
an HF checkpoint (config.json, model.safetensors, tokenizer.json) that the main job starts RL from.

    python launch/sft.py --config=configs/tiny_agentic.py --out=checkpoints/tiny_agentic_sft

It trains `config.model` (random initialisation, `config.seed`) on fresh demonstrations of
`config.tasks` until the policy, sampled at the rollout temperature, solves `config.sft.target` of the
probe tasks (checked every `sft.probe_every` steps from `sft.min_steps`; `sft.steps` caps it), the rule
`launch/train.py --config.warm_start=scratch` runs inside the main job. Beside the checkpoint it writes
`warm_start.json`: the steps taken, the NLL curve, every probe, the settings and the git commit.
`--snapshots` also keeps the weights at every probe under OUT/snapshots/step_N.

`--init=DIR` starts from an HF checkpoint's weights instead (a further stage of a warm start: its steps,
schedule and probes count from 0, with a fresh optimizer); `warm_start.json` records it.
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax import interrupts  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/tiny_agentic.py")
flags.DEFINE_string("out", "checkpoints/tiny_agentic_sft", "Directory of the HF checkpoint to write.")
flags.DEFINE_bool("snapshots", False, "Also write the weights at every probe (OUT/snapshots/step_N).")
flags.DEFINE_string("init", "", "Start from this HF checkpoint's weights instead of random ones (a further stage).")
distributed.define_flags()
FLAGS = flags.FLAGS


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv):
    del argv
    console.setup()
    interrupts.install()  # SIGTERM (Slurm, Kubernetes, preemption) as Ctrl-C
    try:
        _main(_CONFIG.value)
    except KeyboardInterrupt:
        print(f"\ninterrupted by {interrupts.name()}: launch/sft.py writes its checkpoint only at the end, so nothing "
              f"was saved; the same command starts over: {interrupts.command()}", flush=True)
        sys.exit(130)


def _main(cfg):
    try:
        config_lib.apply_platform_settings(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    import jax
    from flax import nnx

    from tiderl_jax.engine.engine import Engine
    from tiderl_jax.model.hf_io import export_policy
    from tiderl_jax.rl import sft

    try:
        with cfg.unlocked():  # the warm start begins from random weights, or --init's
            cfg.warm_start, cfg.checkpoint = ("checkpoint", FLAGS.init) if FLAGS.init else ("scratch", "")
        config_lib.check_main_job(cfg)
        _, _, ecfg, rcfg, warm_cfg = config_lib.rl_configs(cfg)
        _, _, tokenizer, model = config_lib.build(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    graphdef, params = nnx.split(model)
    engine_model = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
    engine_model.activation_sharding = None
    engine = Engine(engine_model, ecfg)
    probes = []

    def on_probe(step, success, weights):
        probes.append(dict(step=step, sampled_success=success))
        if FLAGS.snapshots:
            export_policy(graphdef, weights, tokenizer, os.path.join(FLAGS.out, "snapshots", f"step_{step}"))

    t0 = time.perf_counter()
    s = cfg.sft
    weights, curve = sft.warm_start_policy(
        model, tokenizer, tuple(cfg.tasks), s.to_dict(), warm_cfg, engine=engine,
        load=lambda p: engine.update_params(p, 0), rollout=rcfg, seed=cfg.seed, on_probe=on_probe)
    seconds = time.perf_counter() - t0
    size = export_policy(graphdef, weights, tokenizer, FLAGS.out)
    meta = dict(command=" ".join(["python"] + sys.argv), commit=_commit(), steps=len(curve),
                nll_first=curve[0], nll_last=curve[-1], probes=probes, seconds=round(seconds, 1),
                bytes=size, tasks=list(cfg.tasks), seed=cfg.seed, sft=s.to_dict(), init=FLAGS.init or None,
                nll=curve)
    with open(os.path.join(FLAGS.out, "warm_start.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"warm start: {len(curve)} steps in {seconds:.0f}s, NLL {curve[0]:.3f} -> {curve[-1]:.3f}; "
          f"wrote {FLAGS.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/sft.py"))
