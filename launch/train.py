"""The main job: supervised warm start, then RL (TideRL GRPO by default) on built-in agentic tasks.

    python launch/train.py --config=configs/tiny_agentic.py [--config.controller.mode=sync]

Steps: build the model and tokenizer from the config; if the log directory holds a checkpoint,
resume from it (the warm start is part of it); otherwise run the SFT warm start on the tasks'
demonstrations and checkpoint it. Measure held-out reward, run the controller (rollout, scoring,
training, weight sync, ERS), measure held-out reward again, and print the summary (held-out reward
before/after, goodput, waiting, KV hit rate) and the path of the timeline PNG.

Ctrl-C saves a checkpoint (the ready buffer and the in-flight groups included) and exits with
status 130; running the same command again resumes.
"""

import asyncio
import dataclasses
import json
import logging as pylogging
import os
import sys
import time

import jax
from absl import app, logging
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402
from tiderl_jax.rl import evaluate, sft  # noqa: E402
from tiderl_jax.rl.losses import from_config_dict  # noqa: E402
from tiderl_jax.rl.trainer import Trainer, TrainerConfig  # noqa: E402
from tiderl_jax.runtime.controller import Controller, ControllerConfig  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/tiny_agentic.py")


def _configs(cfg):
    """Typed configs from the ConfigDict; ConfigError names a bad key or value."""
    try:
        controller = ControllerConfig(**{**cfg.controller.to_dict(), "task_kinds": tuple(cfg.tasks)})
        trainer = TrainerConfig(loss=from_config_dict(cfg.loss), total_steps=max(controller.steps, 2),
                                temperature=cfg.rollout.temperature, **cfg.trainer.to_dict())
        engine = EngineConfig(**cfg.engine.to_dict())
        rollout = RolloutConfig(**cfg.rollout.to_dict())
        warm = dataclasses.replace(trainer, learning_rate=cfg.sft.learning_rate, row_len=cfg.sft.row_len,
                                   warmup_steps=min(trainer.warmup_steps, max(cfg.sft.steps - 1, 0)),
                                   total_steps=max(cfg.sft.steps, 1))
    except (TypeError, ValueError) as e:  # an unknown key in a section, or a refused value
        raise ConfigError(f"config: {e}") from None
    return controller, trainer, engine, rollout, warm


def _heldout(engine: Engine, tokenizer, cfg, rollout: RolloutConfig) -> dict:
    greedy = dataclasses.replace(rollout, temperature=0.0, mode="request")
    return {kind: evaluate.heldout_reward(engine, tokenizer, kind, cfg.eval.tasks, greedy)
            for kind in cfg.tasks}


def _warm_start(controller: Controller, warm: Trainer, tokenizer, cfg, rollout: RolloutConfig) -> list[float]:
    """The SFT warm start (`sft.warm_start_until`): with `sft.target` > 0 it stops once the policy, loaded
    into the controller and sampled at the rollout temperature, solves that share of `sft.probe_tasks` probe
    tasks (another train stream) x `sft.probe_samples`; `sft.steps` caps it. Returns the NLL per step."""
    s = cfg.sft
    probe_tasks = sft.train_tasks(cfg.tasks, 0, s.get("probe_tasks", 16), cfg.seed + 1)
    sampled = dataclasses.replace(rollout, mode="request")

    def probe() -> float:
        controller.load_policy(warm.params)
        groups = evaluate.sample_groups(controller.engine, tokenizer, probe_tasks, s.get("probe_samples", 4), sampled)
        return sum(t.reward for t in groups) / len(groups)
    return sft.warm_start_until(warm, tokenizer, cfg.tasks, s.steps, s.batch_size, probe=probe,
                                target=s.get("target", 0.0), min_steps=s.get("min_steps", 0),
                                probe_every=s.get("probe_every", 25), seed=cfg.seed, log_every=s.log_every,
                                log=lambda line: print(line, flush=True))


def main(argv):
    del argv
    cfg = _CONFIG.value
    config_lib.apply_platform_settings(cfg)
    logging.set_verbosity(logging.INFO)
    pylogging.getLogger("absl").setLevel(pylogging.WARNING)  # orbax's per-save chatter (after the above)
    pylogging.getLogger("tiderl_jax").setLevel(pylogging.INFO)
    try:
        mesh, rules, tokenizer, model = config_lib.build(cfg)
        ccfg, tcfg, ecfg, rcfg, sft_cfg = _configs(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(cfg.logdir, exist_ok=True)
    t_start = time.perf_counter()
    latency = LatencyModel(**cfg.latency.to_dict())
    controller = Controller(model, tokenizer, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                            trainer_config=tcfg, latency=latency, logdir=cfg.logdir, rules=rules)
    state_path = os.path.join(cfg.logdir, "run_state.json")
    if controller.restore():
        with open(state_path) as f:
            before = json.load(f)["heldout_before"]
        print(f"resumed from {cfg.logdir} at step {controller.step}")
    else:
        # The warm start runs on one device: faked devices share the same two cores, so sharding
        # the SFT over them adds only overhead; RL below runs on the controller's device groups.
        graphdef, params = nnx.split(model)
        single = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
        single.activation_sharding = None
        warm = Trainer(single, sft_cfg)
        curve = _warm_start(controller, warm, tokenizer, cfg, rcfg)
        print(f"warm start: NLL {curve[0]:.3f} -> {curve[-1]:.3f} over {len(curve)} steps", flush=True)
        controller.load_policy(warm.params)
        before = _heldout(controller.engine, tokenizer, cfg, rcfg)
        with open(state_path, "w") as f:
            json.dump({"heldout_before": before}, f)
        controller.save(wait=True)  # step 0: a resume skips the warm start
    logging.info("held-out reward before RL: %s", before)
    try:
        summary = asyncio.run(controller.run())
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {controller.step}: checkpoint saved in {cfg.logdir}/checkpoints; "
              f"run the same command to resume")
        sys.exit(130)
    after = _heldout(controller.engine, tokenizer, cfg, rcfg)
    png = controller.metrics.plot_timeline(os.path.join(cfg.logdir, "timeline.png"))
    controller.metrics.close()
    controller.checkpointer.close()
    total = time.perf_counter() - t_start
    rows = [("mode", ccfg.mode), ("updates", summary["steps"]),
            ("held-out reward before", " ".join(f"{k} {v:.3f}" for k, v in before.items())),
            ("held-out reward after", " ".join(f"{k} {v:.3f}" for k, v in after.items())),
            ("goodput", f"{summary['goodput_tokens_per_s']:.0f} tokens/s, "
                        f"{summary['goodput_samples_per_s']:.2f} samples/s"),
            ("step time", f"{summary['step_time_s']:.2f}s"),
            ("waiting (device-s)", f"rollout {summary['rollout_wait_s']:.0f}, trainer {summary['trainer_wait_s']:.0f}"),
            ("KV hit rate", f"{summary['kv_hit_rate']:.3f}"),
            ("staleness (lag: tokens)", summary["staleness"]),
            ("ERS moves", summary["moves"]), ("discarded samples", summary["discarded"]),
            ("RL wall time", f"{summary['wall_s']:.0f}s"),
            ("wall time", f"{total:.0f}s (this invocation, warm start and evaluations included)"),
            ("timeline", png),
            ("metrics", f"{cfg.logdir}/metrics.jsonl, TensorBoard events in {cfg.logdir}")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    with open(os.path.join(cfg.logdir, "summary.json"), "w") as f:
        json.dump(dict(summary, heldout_before=before, heldout_after=after, wall_s=total), f, indent=1)
    print(f"devices: {len(jax.devices())} {jax.devices()[0].platform}")


if __name__ == "__main__":
    app.run(main)
