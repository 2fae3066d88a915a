"""The main job: RL (TideRL GRPO by default) on multi-turn tool tasks, from a warm-started policy.

    python launch/train.py --config=configs/tiny_agentic.py [--config.controller.mode=sync]

Phases, each with a progress line (global step / total, rate, ETA):
1. **Start**: every config check runs before anything is built (bad input exits with status 2 and one
   line naming the key or file); then the model: the shipped warm-started checkpoint
   (`config.checkpoint`, with `config.warm_start="checkpoint"`), or random weights and the supervised
   warm start (`config.warm_start="scratch"`, `launch/sft.py`'s rule).
2. **Held-out before**: `eval.tasks` held-out tasks (the kinds pooled), greedy and sampled at the
   rollout temperature (fixed per-task seeds: common random numbers before and after).
3. **RL**: the controller (rollout, scoring, training, weight sync, ERS) for `controller.steps` updates.
4. **Held-out after**, on the same tasks and seeds; the gain with its 95% paired-bootstrap interval.
5. **Summary**: a table, `summary.json`, `learning.png` (reward and held-out curves) and
   `timeline.png` (what each device group did) in `config.logdir`.

Ctrl-C in any phase saves what there is (the warm start's weights, or the RL checkpoint with its ready
and in-flight samples) and exits with status 130; the same command resumes. A log directory that holds
a run of another configuration is refused (use another `--config.logdir`). A failure (an engine step
that raises, weight syncs that keep failing) ends the run with the error named, after a checkpoint.
"""

import asyncio
import json
import logging as pylogging
import os
import sys
import time

from absl import app, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/tiny_agentic.py")
# keys a resumed run may change (how long to train, how much to evaluate, where progress goes)
_RESUMABLE_CHANGES = ("controller.steps", "eval.", "sft.log_every")


def _fail(message: str, status: int = 2):
    message = " | ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
    return out


class RunState:
    """`run_state.json` in the log directory: the run's config and what its finished phases produced."""

    def __init__(self, logdir: str, config: dict):
        self.path = os.path.join(logdir, "run_state.json")
        self.config = _flat(config)
        self.data = {}
        if os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    self.data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{self.path}: unreadable ({e}); delete the log directory to start over") from None

    def check_same_run(self, logdir: str) -> None:
        """A resume must continue the same run: a different config in the same log directory is refused."""
        old = self.data.get("config")
        if old is None:
            return
        diff = [k for k in sorted(set(old) | set(self.config)) if old.get(k) != self.config.get(k)
                and k != "logdir" and not k.startswith(_RESUMABLE_CHANGES)]
        if diff:
            shown = ", ".join(f"{k}: {old.get(k)!r} -> {self.config.get(k)!r}" for k in diff[:3])
            raise ConfigError(f"{logdir} holds a run of another configuration ({shown}"
                              f"{', ...' if len(diff) > 3 else ''}); resume it with its own settings, or "
                              f"pass another --config.logdir (or delete {logdir}) to start a new run")

    def save(self, **updates) -> None:
        self.data.update(updates, config=self.config)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


class Phases:
    """Wall seconds per phase of this invocation (summary.json's `phases_s`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.current = "start"
        self._t = time.perf_counter()

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._t
        self.current, self._t = name, now


def _check_prompts(cfg, tokenizer) -> None:
    """The tasks' first prompts must leave room for a turn in the context (else every sample fails)."""
    from tiderl_jax.agents import tasks
    from tiderl_jax.agents.tasks import SYSTEM_PROMPT
    from tiderl_jax.model import chat

    room = cfg.rollout.max_context - cfg.rollout.max_new_tokens
    for kind in cfg.tasks:
        for split in ("train", "heldout"):
            for i in range(8):
                task = tasks.make_task(kind, i, split, cfg.seed)
                messages = [chat.Message("system", SYSTEM_PROMPT), chat.Message("user", task.prompt)]
                n = len(chat.encode(tokenizer, messages, add_generation_prompt=True).ids)
                if n > room:
                    raise ConfigError(f"the {kind} task's prompt ({task.task_id}) is {n} tokens, but "
                                      f"rollout.max_context={cfg.rollout.max_context} minus "
                                      f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves {room}")


def _evaluate(controller, tokenizer, cfg, rollout, when: str) -> dict:
    """Held-out success, greedy and sampled, on the pooled held-out tasks (`rl.evaluate.heldout_results`)."""
    import dataclasses

    from tiderl_jax.progress import Progress, format_seconds
    from tiderl_jax.rl import evaluate

    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", rollout.temperature)):
        t0 = time.perf_counter()
        config = dataclasses.replace(rollout, temperature=temperature, mode="request", seed=cfg.seed + 7)
        bar = Progress(f"held-out {when} ({name})", cfg.eval.tasks, unit="task", every=cfg.eval.tasks // 4 or 1)
        out[name] = evaluate.heldout_results(controller.engine, tokenizer, tuple(cfg.tasks), cfg.eval.tasks,
                                             config, progress=bar.update)
        bar.close()
        rewards = out[name]["rewards"]
        print(f"held-out {when} ({name}): {sum(r >= 1 for r in rewards)}/{len(rewards)} solved, mean reward "
              f"{sum(rewards) / len(rewards):.3f} [{format_seconds(time.perf_counter() - t0)}]", flush=True)
    return out


def _by_kind(results: dict) -> dict:
    kinds = {}
    for kind, reward in zip(results["kinds"], results["rewards"]):
        kinds.setdefault(kind, []).append(reward)
    return {k: sum(v) / len(v) for k, v in kinds.items()}


def main(argv):
    del argv
    try:
        _main(_CONFIG.value)
    except KeyboardInterrupt:  # before anything was built (the phases below handle their own)
        print("\ninterrupted while starting; nothing to save", flush=True)
        sys.exit(130)


def _main(cfg):
    config_lib.apply_platform_settings(cfg)
    logging.set_verbosity(logging.INFO)
    pylogging.getLogger("absl").setLevel(pylogging.WARNING)  # orbax's per-save chatter (after the above)
    pylogging.getLogger("tiderl_jax").setLevel(pylogging.INFO)
    phases = Phases()
    try:  # every check that needs no model, then the model
        config_lib.check_main_job(cfg)
        if cfg.warm_start == "scratch":
            with cfg.unlocked():
                cfg.checkpoint = ""  # random weights; the warm start below trains them
        ccfg, tcfg, ecfg, rcfg, sft_cfg = config_lib.rl_configs(cfg)
        tokenizer = config_lib.build_tokenizer(cfg)
        _check_prompts(cfg, tokenizer)
        state = RunState(cfg.logdir, cfg.to_dict())
        state.check_same_run(cfg.logdir)
        _, rules, tokenizer, model = config_lib.build(cfg)
    except ConfigError as e:
        _fail(str(e))
    from tiderl_jax.agents.env import LatencyModel
    from tiderl_jax.progress import CompileWatch
    from tiderl_jax.runtime.controller import Controller

    compiles = CompileWatch().start()

    os.makedirs(cfg.logdir, exist_ok=True)
    controller = None
    try:
        controller = Controller(model, tokenizer, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                                trainer_config=tcfg, latency=LatencyModel(**cfg.latency.to_dict()),
                                logdir=cfg.logdir, rules=rules)
        resumed = controller.restore()
    except ConfigError as e:
        _fail(str(e))
    print(f"model: {model.cfg.arch}, {_num_params(model) / 1e6:.2f}M parameters "
          f"({'from ' + cfg.checkpoint if cfg.checkpoint else 'random weights, warm start first'}); "
          f"tasks {', '.join(cfg.tasks)}; {ccfg.mode} on {len(controller.backend.devices)} devices", flush=True)
    try:
        if resumed:
            print(f"resumed from {cfg.logdir} at step {controller.step}/{ccfg.steps}", flush=True)
        else:
            if cfg.warm_start == "scratch":
                phases.enter("warm start")
                from tiderl_jax.rl import sft
                weights, curve = sft.warm_start_policy(
                    model, tokenizer, tuple(cfg.tasks), cfg.sft.to_dict(), sft_cfg, engine=controller.engine,
                    load=controller.load_policy, rollout=rcfg, seed=cfg.seed,
                    resume_dir=os.path.join(os.path.abspath(cfg.logdir), "warm_start"))
                if curve:
                    print(f"warm start: NLL {curve[0]:.3f} -> {curve[-1]:.3f} over {len(curve)} steps", flush=True)
                controller.load_policy(weights)
            controller.save(wait=True)  # step 0: a resume starts from here
        if "heldout_before" not in state.data:
            if controller.step > 0:
                raise ConfigError(f"{cfg.logdir} holds RL step {controller.step} but no held-out result from "
                                  f"before RL; delete it to start over")
            phases.enter("held-out before")
            state.save(heldout_before=_evaluate(controller, tokenizer, cfg, rcfg, "before"))
        before = state.data["heldout_before"]
        if "rl_summary" not in state.data or controller.step < ccfg.steps:
            phases.enter("RL")
            summary = asyncio.run(controller.run())
            state.save(rl_summary=dict(summary, rewards=controller.metrics.rewards))
        summary = state.data["rl_summary"]
        phases.enter("held-out after")
        if controller.step < ccfg.steps:  # the run stopped early (e.g. the producer failed)
            raise RuntimeError(f"RL ended at step {controller.step} of {ccfg.steps}")
        after = _evaluate(controller, tokenizer, cfg, rcfg, "after")
        state.save(heldout_after=after)
        phases.enter("summary")
        compiles.stop()
        _report(cfg, ccfg, controller, summary, before, after, phases, compiles)
    except KeyboardInterrupt:
        where = phases.current
        print(f"\ninterrupted in {where} at RL step {controller.step}/{ccfg.steps}: saved in {cfg.logdir}; "
              f"run the same command to resume", flush=True)
        sys.exit(130)
    except ConfigError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - the user gets the error named, not a traceback
        import traceback
        trace = os.path.join(cfg.logdir, "error.log")
        with open(trace, "a") as f:
            traceback.print_exc(file=f)
        cause = e.__cause__ or e
        _fail(f"{phases.current} failed: {type(e).__name__}: {e}"
              + (f" (caused by {type(cause).__name__}: {cause})" if cause is not e else "")
              + f"; the last checkpoint is in {cfg.logdir}/checkpoints, the traceback in {trace}", status=1)
    finally:
        if controller is not None:
            controller.metrics.close()
            if controller.checkpointer is not None:
                controller.checkpointer.close()


def _num_params(model) -> int:
    import jax
    from flax import nnx
    return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


def _report(cfg, ccfg, controller, summary, before, after, phases, compiles) -> None:
    from tiderl_jax.rl import stats
    from tiderl_jax.runtime import plots

    import jax

    gains = {}
    for name in ("greedy", "sampled"):
        gains[name] = stats.paired_bootstrap(before[name]["rewards"], after[name]["rewards"], seed=cfg.seed)
    png = controller.metrics.plot_timeline(os.path.join(cfg.logdir, "timeline.png"))
    curves = plots.learning_curves(os.path.join(cfg.logdir, "metrics.jsonl"), before, after, gains,
                                   os.path.join(cfg.logdir, "learning.png"))
    phases.enter("done")
    total = sum(phases.seconds.values())
    rl_s = phases.seconds.get("RL", 0.0)
    n = len(before["greedy"]["rewards"])

    def solved(results):
        return f"{sum(r >= 1 for r in results['rewards'])}/{len(results['rewards'])}"

    rewards = summary.get("rewards") or [float("nan")]
    k = max(1, len(rewards) // 4)
    rows = [("mode", ccfg.mode), ("updates", f"{summary['steps']} x {ccfg.batch_samples} samples"),
            ("train reward", f"first quarter of the updates {sum(rewards[:k]) / k:.3f}, last quarter "
                             f"{sum(rewards[-k:]) / k:.3f}")]
    for name in ("greedy", "sampled"):
        d, lo, hi = gains[name]
        b, a = before[name], after[name]
        rows += [(f"held-out {name}", f"{solved(b)} -> {solved(a)} tasks solved; gain {d:+.3f} "
                                      f"[95% CI {lo:+.3f}, {hi:+.3f}]"),
                 (f"  by kind", "  ".join(f"{k} {_by_kind(b)[k]:.3f} -> {_by_kind(a)[k]:.3f}" for k in _by_kind(b)))]
    rows += [("goodput", f"{summary['goodput_tokens_per_s']:.0f} tokens/s, "
                         f"{summary['goodput_samples_per_s']:.2f} samples/s"),
             ("step time", f"{summary['step_time_s']:.2f}s"),
             ("waiting (device-s)", f"rollout {summary['rollout_wait_s']:.0f}, trainer {summary['trainer_wait_s']:.0f}"),
             ("KV hit rate", f"{summary['kv_hit_rate']:.3f}"),
             ("ERS moves", summary["moves"]), ("discarded samples", summary["discarded"]),
             ("compiles", f"{compiles.count} device programs, {compiles.seconds:.0f}s (in the times below)"),
             ("time", " | ".join(f"{k} {v:.0f}s" for k, v in phases.seconds.items() if v >= 0.5)
              + f" | RL {100 * rl_s / max(total, 1e-9):.0f}% of {total:.0f}s"),
             ("plots", f"{curves}, {png}"),
             ("metrics", f"{cfg.logdir}/metrics.jsonl, TensorBoard: tensorboard --logdir {cfg.logdir}")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
    d, lo, hi = gains["greedy"]
    out = dict(summary, heldout_by_kind_before={k: _by_kind(before[k]) for k in before},
               heldout_by_kind_after={k: _by_kind(after[k]) for k in after}, heldout_tasks=n,
               heldout_gain=d, heldout_gain_ci95=[lo, hi],
               heldout_gain_sampled=gains["sampled"][0], heldout_gain_sampled_ci95=list(gains["sampled"][1:]),
               heldout_success_before={k: sum(before[k]["rewards"]) / n for k in before},
               heldout_success_after={k: sum(after[k]["rewards"]) / n for k in after},
               rl_wall_s=summary["wall_s"], wall_s=total, compiled_programs=compiles.count,
               compile_s=compiles.seconds, phases_s=phases.seconds, devices=len(jax.devices()),
               platform=jax.devices()[0].platform)
    with open(os.path.join(cfg.logdir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
