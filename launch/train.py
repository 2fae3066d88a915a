"""The main job: RL (TideRL GRPO by default) on multi-turn tool tasks, from a warm-started policy.

    python launch/train.py --config=configs/tiny_agentic.py [--config.controller.mode=sync]

Phases, each with a progress line (global step / total, rate, ETA):
1. **Start**: every config check runs before anything is built (bad input exits with status 2 and one
   line naming the key or file); then the model: the shipped warm-started checkpoint
   (`config.checkpoint`, with `config.warm_start="checkpoint"`), or random weights and the supervised
   warm start (`config.warm_start="scratch"`, `launch/sft.py`'s rule).
2. **Held-out before**: `eval.tasks` held-out tasks (the kinds pooled), greedy and sampled at the
   rollout temperature (fixed per-task seeds: common random numbers before and after).
3. **RL**: the controller (rollout, scoring, training, weight sync, ERS) for `controller.steps` updates;
   every `eval.every` updates (0: never) the first `eval.during_tasks` held-out tasks, greedy, on the latest
   weights (a printed line, metrics.jsonl's `eval_*` keys, `rollouts/during_rl_step_<N>.jsonl`).
4. **Held-out after**, on the same tasks and seeds; the gain with its 95% paired-bootstrap interval.
5. **Summary**: a table, `summary.json`, `learning.png` (reward and held-out curves), `reward_curve.png`
   (reward per update with its spread, the evaluations during RL, the groups with no GRPO signal) and
   `timeline.png` (this invocation's phases, and what each device group did in RL) in `config.logdir`
   (`tiderl_jax/run_report.py`). The warm start's NLL and probe success are TensorBoard's `sft/` scalars.

6. **The policy**: exported in HF format to `config.logdir/hf_export/` (`launch/generate.py
   --checkpoint=...` loads it; `--config.export_every_checkpoint=true` also exports at each RL checkpoint,
   to `hf_export_steps/step_N/`); every held-out rollout is in `rollouts/*.jsonl`, decoded.

The resolved config is written to `config.json`. Ctrl-C or SIGTERM (what Slurm, Kubernetes and preemptible VMs
send before a kill) in any phase saves what there is (the warm start's weights, or the RL checkpoint with its
ready and in-flight samples), prints the signal and the command, and exits with status 130; the same command
resumes. A log directory that holds a run of another configuration is refused, naming
every differing key (`tiderl_jax/run_state.py`: only the step budget and a few harmless keys may change);
a finished run says so and exits 0, overwriting nothing; a raised `controller.steps` continues it. A
failure (an engine step that raises, weight syncs that keep failing) ends the run with the error named,
after a checkpoint.
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
from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax import interrupts  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/tiny_agentic.py")
distributed.define_flags()


def _fail(message: str, status: int = 2, saved_stderr: int | None = None):
    message = " | ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    cluster = distributed.cluster()
    where = f"process {cluster.index}: " if cluster.multi else ""
    if cluster.multi:  # not JAX's exit barrier: the other processes may be gone (they are told by the heartbeat)
        print(f"error: {where}{message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status)
    # the one line is the last this process writes on stderr: fd 2 goes to /dev/null first and the line to a copy
    # of it, so a library's background work failing meanwhile prints its traceback nowhere, not even between the two
    if saved_stderr is None:
        saved_stderr = _stderr_to_devnull()
    os.write(saved_stderr, f"error: {where}{message}\n".encode())
    os.close(saved_stderr)
    sys.exit(status)


def _stderr_to_devnull() -> int:
    """Points fd 2 at /dev/null; returns a copy of where it pointed."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


def _restore_quietly(controller):
    """controller.restore() with fd 2 at /dev/null while it runs (one process): a damaged checkpoint also fails in
    orbax's reader threads, which print tracebacks (their event loop closed under them) before and after the error
    the restore names. A ConfigError ends the run with its one line; anything else gets stderr back first."""
    if distributed.cluster().multi:
        return controller.restore()
    saved = _stderr_to_devnull()
    try:
        resumed = controller.restore()
    except ConfigError as e:
        _fail(str(e), saved_stderr=saved)
    except BaseException:
        _stderr_back(saved)
        raise
    _stderr_back(saved)
    return resumed


def _stderr_back(saved: int) -> None:
    """Points fd 2 where `_stderr_to_devnull` found it."""
    os.dup2(saved, 2)
    os.close(saved)


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


def _check_dataset_prompts(cfg, tokenizer, data):
    """A dataset's rows whose first prompt leaves no room for a turn are dropped at the start (a warning names
    the first few: file, row, tokens), as veRL's `filter_overlong_prompts` does; every row too long is an error."""
    import dataclasses

    from tiderl_jax.agents import rollout as rollout_lib
    from tiderl_jax.model.chat_template import ChatTemplate

    room = cfg.rollout.max_context - cfg.rollout.max_new_tokens
    template = ChatTemplate.for_tokenizer(tokenizer)

    def fits(task) -> bool:
        try:
            _, encoded = rollout_lib.first_prompt(tokenizer, template, task.prompt, rollout_lib.system_prompt(task))
        except ValueError as e:
            logging.warning("dataset row %s: its prompt cannot be encoded (%s); skipped", task.data.get("source"), e)
            return False
        if len(encoded.ids) > room:
            logging.warning("dataset row %s: its prompt is %d tokens, more than the %d that rollout.max_context=%d "
                            "leaves with rollout.max_new_tokens=%d; skipped", task.data.get("source"),
                            len(encoded.ids), room, cfg.rollout.max_context, cfg.rollout.max_new_tokens)
            return False
        return True

    dropped = 0
    if data.train is not None:
        dataset = data.train.dataset
        kept = tuple(t for t in dataset.tasks if fits(t))
        dropped += len(dataset.tasks) - len(kept)
        if not kept:
            raise ConfigError(f"data.train_files: no row's prompt fits rollout.max_context={cfg.rollout.max_context} "
                              f"with rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
        data.train.dataset = dataclasses.replace(dataset, tasks=kept)
    heldout = tuple(t for t in data.heldout if fits(t))
    dropped += len(data.heldout) - len(heldout)
    if data.heldout and not heldout:
        raise ConfigError(f"data.heldout_files: no row's prompt fits rollout.max_context={cfg.rollout.max_context}")
    return dataclasses.replace(data, heldout=heldout), dropped


def _heldout(cfg, data, n: int):
    """The first `n` held-out tasks: the dataset's held-out rows, or the built-in kinds' (pooled)."""
    from tiderl_jax.rl import evaluate

    return list(data.heldout[:n]) if data is not None else evaluate.heldout_tasks(tuple(cfg.tasks), n)


def _evaluate(controller, tokenizer, cfg, rollout, when: str, data=None) -> dict:
    """Held-out success, greedy and (`eval.sampled`) sampled, on the pooled held-out tasks of the built-in kinds or the dataset's
    held-out rows (`_heldout`);
    the rollouts themselves go to `rollouts/heldout_<when>_<greedy|sampled>.jsonl`, decoded."""
    import dataclasses

    from tiderl_jax import run_report
    from tiderl_jax.progress import Progress, format_seconds
    from tiderl_jax.rl import evaluate

    out = {}
    for name, temperature in evaluation_modes(cfg, rollout):
        t0 = time.perf_counter()
        config = dataclasses.replace(rollout, temperature=temperature, mode="request", seed=cfg.seed + 7)
        tasks = _heldout(cfg, data, cfg.eval.tasks)
        bar = Progress(f"held-out {when} ({name})", len(tasks), unit="task", every=len(tasks) // 4 or 1)
        cluster = distributed.cluster()  # across processes each evaluates its share, and all get every result
        mine = [tasks[i] for i in distributed.shard_indices(len(tasks), cluster.index, cluster.count)]
        trajectories = evaluate.sample_groups(_every_replica(controller), tokenizer, mine, 1, config, progress=bar.update,
                                              make_env=data.make_env if data is not None else None)
        trajectories = distributed.merge_shards(cluster.allgather(f"held-out {when} ({name})", trajectories))
        bar.close()
        if cluster.primary:
            evaluate.save_readable(trajectories, tokenizer,
                                   os.path.join(cfg.logdir, "rollouts", f"heldout_{when}_{name}.jsonl"))
        out[name] = evaluate.results_of(trajectories)
        rewards = out[name]["rewards"]
        print(f"held-out {when} ({name}): {run_report.count_rate(rewards)} solved, mean reward "
              f"{sum(rewards) / len(rewards):.3f} [{format_seconds(time.perf_counter() - t0)}]", flush=True)
    return out


def evaluation_modes(cfg, rollout) -> tuple[tuple[str, float], ...]:
    """The held-out evaluation's (name, temperature) pairs: greedy, and sampled unless `eval.sampled` is off."""
    return (("greedy", 0.0),) + ((("sampled", rollout.temperature),) if cfg.eval.get("sampled", True) else ())


def _every_replica(controller):
    """What the held-out evaluation runs on: the one rollout engine, or a rollout service over every replica
    (`controller.rollout_replicas=group`; the least-loaded router spreads the tasks)."""
    engines = controller.backend.engines
    if len(engines) == 1:
        return engines[0]
    from tiderl_jax.serving.service import RolloutService, ServiceConfig
    return RolloutService(engines, ServiceConfig(policy="least_loaded"))


def _evaluation_during_rl(controller, tokenizer, cfg, data=None):
    """`Controller.run(on_step=...)`'s hook: every `eval.every` updates (0: never), the first `eval.during_tasks`
    held-out tasks, greedy, through the running rollout loop on the latest weights; their results
    (`health.eval_stats`) become the update's `eval_*` keys in metrics.jsonl (TensorBoard `eval/`), a line
    is printed, and the rollouts go to `rollouts/during_rl_step_<N>.jsonl`."""
    from tiderl_jax import run_report
    from tiderl_jax.rl import evaluate
    from tiderl_jax.runtime import health

    every = cfg.eval.get("every", 0)
    during = _heldout(cfg, data, cfg.eval.get("during_tasks", 1)) if every else []

    async def evaluate_during_rl(step: int):
        if not every or step % every:
            return None
        t0 = time.perf_counter()
        cluster = distributed.cluster()  # each process its share (`_evaluate`)
        mine = [during[i] for i in distributed.shard_indices(len(during), cluster.index, cluster.count)]
        trajectories = await controller.backend.run_tasks(mine, temperature=0.0, seed=cfg.seed + 7)
        trajectories = distributed.merge_shards(await cluster.allgather_async(f"held-out during RL at step {step}",
                                                                              trajectories))
        if cluster.primary:
            evaluate.save_readable(trajectories, tokenizer,
                                   os.path.join(cfg.logdir, "rollouts", f"during_rl_step_{step}.jsonl"))
        stats = health.eval_stats(trajectories)
        print(f"held-out during RL (step {step}, greedy): "
              f"{run_report.count_rate([t.reward for t in trajectories])} solved, mean reward "
              f"{stats['reward']:.3f} [{time.perf_counter() - t0:.1f}s]", flush=True)
        return stats
    return evaluate_during_rl


def _warm_start(cfg, model, tokenizer, controller, sft_cfg, rcfg):
    """The supervised warm start (`sft.warm_start_policy`), its probes and NLL curve logged as TensorBoard
    scalars `sft/probe_success` and `sft/nll` at the warm start's own step. Returns the weights."""
    from tiderl_jax.rl import sft
    from tiderl_jax.rl.checkpoint import Checkpointer

    resume_dir = os.path.join(os.path.abspath(cfg.logdir), "warm_start")
    saved = Checkpointer(resume_dir, keep=1, async_save=False)  # where a resumed warm start goes on from
    start = saved.latest_step() or 0
    saved.close()

    def on_probe(step, success, params):
        del params
        controller.metrics.log_scalars("sft", step, {"probe_success": success})
    weights, curve = sft.warm_start_policy(
        model, tokenizer, tuple(cfg.tasks), cfg.sft.to_dict(), sft_cfg, engine=controller.engine,
        load=controller.load_policy, rollout=rcfg, seed=cfg.seed, on_probe=on_probe, resume_dir=resume_dir)
    for i, nll in enumerate(curve):
        controller.metrics.log_scalars("sft", start + i + 1, {"nll": nll})
    if curve:
        print(f"warm start: NLL {curve[0]:.3f} -> {curve[-1]:.3f} over {len(curve)} steps", flush=True)
    return weights


def _export(controller, tokenizer, path: str) -> str:
    """The policy the trainer holds, as an HF checkpoint (`hf_io.export_policy`)."""
    from tiderl_jax.model.hf_io import export_policy
    from tiderl_jax.model.sharding import local_replica

    trainer = controller.trainer
    params = local_replica(trainer.params)  # across processes: gathered by all, written by process 0
    if distributed.cluster().primary:
        export_policy(trainer.graphdef, params, tokenizer, path,
                      meta=dict(step=controller.step, version=controller.version, mode=controller.cfg.mode))
    return path


def _export_at_checkpoints(controller, tokenizer, logdir: str) -> None:
    """Every RL checkpoint (`Controller.save`) also exports the policy, to hf_export_steps/step_N/."""
    save = controller.save

    def save_and_export(wait: bool = False) -> None:
        save(wait=wait)
        _export(controller, tokenizer, os.path.join(logdir, "hf_export_steps", f"step_{controller.step}"))
    controller.save = save_and_export


def _ledger(controller, state) -> dict:
    """The whole run's sample ledger with each term of its identity (`run_report.ledger_accounts`); the groups
    of the update being assembled or trained (`Controller.taking`) count as ready: a checkpoint keeps them."""
    from tiderl_jax import run_report

    groups = [*controller.in_flight.values(), *controller.resume_groups]
    local = dict(unfinished=controller.unfinished(),
                 ready=sum(len(g.trajectories) for g in [*controller.taking, *controller.ready]),
                 waiting=sum(len(g.trajectories) for g in groups))
    counts = controller._gathered_counts("ledger accounts", **local)  # every process's (all call it)
    return run_report.ledger_accounts(
        dict(controller.global_ledger()), unfinished=counts["unfinished"], trained=len(controller.consumed),
        ready=counts["ready"], waiting=counts["waiting"], interrupted=state.data.get("lost_at_interruptions", 0))


def _count_lost(controller, state) -> None:
    """RL stopped by an interruption or a failure. `Controller.save` keeps the ready buffer with the update
    being assembled (`taking`) and the in-flight groups, those a resume has not admitted again included; any
    completed sample the ledger cannot place now (its residual) will be neither trained nor generated again.
    run_state keeps their count for the ledger (`run_report.ledger_accounts`)."""
    if distributed.cluster().multi:  # the others may be gone: the accounts need them all
        return
    lost = _ledger(controller, state)["completed_as"]["unexplained"]
    if lost > 0:
        state.save(lost_at_interruptions=state.data.get("lost_at_interruptions", 0) + lost)


def main(argv):
    del argv
    console.setup()  # before JAX logs anything (its backend probe, the coordinator's lines): plain text
    cluster = distributed.initialize_from_flags()  # before any other JAX work
    console.setup(_CONFIG.value.logdir, log_name="log.txt" if cluster.primary else f"log.process_{cluster.index}.txt")
    if not cluster.primary:  # process 0 prints and writes; the others' errors still reach stderr
        sys.stdout = open(os.devnull, "w")
    # SIGTERM (Slurm, Kubernetes, preemption) takes Ctrl-C's path: saved, resumable. Only after initialize:
    # jax.distributed's preemption notifier takes SIGTERM for itself and would swallow it
    interrupts.install()
    try:
        _main(_CONFIG.value)
        cluster.finished()
    except KeyboardInterrupt:  # before anything was built (the phases below handle their own)
        print(f"\ninterrupted by {interrupts.name()} while starting; nothing to save", flush=True)
        sys.exit(130)


def _main(cfg):
    from tiderl_jax.run_report import Phases
    from tiderl_jax.runtime import memory
    from tiderl_jax.run_state import RunState, write_config

    phases = Phases()
    cluster = distributed.cluster()
    if not cluster.primary:
        pylogging.getLogger("tiderl_jax").setLevel(pylogging.WARNING)
    try:  # every check that needs no model, then the model
        platform = config_lib.apply_platform_settings(cfg)
        config_lib.check_main_job(cfg)
        memory.check_fits(cfg, platform)  # a GPU's or TPU's memory, before any weight is loaded
        if cluster.multi and cfg.warm_start == "scratch":
            raise ConfigError("warm_start='scratch' runs on one process: run launch/sft.py there first, then "
                              "this job with warm_start='checkpoint' and checkpoint=<its output>")
        if cfg.warm_start == "scratch":
            with cfg.unlocked():
                cfg.checkpoint = ""  # random weights; the warm start below trains them
        ccfg, tcfg, ecfg, rcfg, sft_cfg = config_lib.rl_configs(cfg)
        tokenizer = config_lib.build_tokenizer(cfg)
        data = config_lib.build_data(cfg)  # None: the built-in tasks
        mixed = config_lib.build_mixture(cfg)  # None: no workload mixture (mixture.target)
        if data is None:
            _check_prompts(cfg, tokenizer)
        else:
            data, too_long = _check_dataset_prompts(cfg, tokenizer, data)
        state = RunState(cfg.logdir, cfg.to_dict(), _defaults(), write=cluster.primary)
        state.check_same_run()
        done = state.finished()
        if done is not None and done["steps"] >= ccfg.steps:
            print(f"{cfg.logdir} holds a finished run ({done['steps']} RL steps, held-out before and after); "
                  f"its summary is {done['summary']}; nothing was run or overwritten. To train it further, "
                  f"raise --config.controller.steps above {done['steps']}; to start a new run, use another "
                  f"--config.logdir or delete {cfg.logdir}", flush=True)
            return
        config_file = write_config(cfg.logdir, cfg.to_dict()) if cluster.primary else \
            os.path.join(cfg.logdir, "config.json")
        if done is not None:
            kept = state.continue_finished(done)
            print(f"continuing the finished run in {cfg.logdir} from {done['steps']} to {ccfg.steps} RL steps"
                  + (f"; its summary so far is kept as {kept}" if kept else ""), flush=True)
        _, rules, tokenizer, model = config_lib.build(cfg)
    except ConfigError as e:
        _fail(str(e))
    from tiderl_jax.agents.env import LatencyModel
    from tiderl_jax.progress import CompileWatch
    from tiderl_jax.runtime.controller import Controller

    compiles = CompileWatch().start()
    cluster.start_watchdog()  # a process that dies or hangs from here on ends the run, named

    controller = None
    try:
        controller = Controller(model, tokenizer, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                                trainer_config=tcfg, latency=LatencyModel(**cfg.latency.to_dict()),
                                logdir=cfg.logdir, rules=rules, task_source=(data and data.train) or mixed,
                                make_env=data and data.make_env)
        resumed = _restore_quietly(controller)
    except ConfigError as e:
        _fail(str(e))
    if cfg.get("export_every_checkpoint", False):
        _export_at_checkpoints(controller, tokenizer, cfg.logdir)
    print(f"model: {model.cfg.arch}, {_num_params(model) / 1e6:.2f}M parameters "
          f"({'from ' + cfg.checkpoint if cfg.checkpoint else 'random weights, warm start first'}); "
          f"{_describe_tasks(cfg, data, too_long if data else 0)}; {ccfg.mode} on {_where(controller, platform)}; "
          f"config in {config_file}", flush=True)
    try:
        if resumed:
            print(f"resumed from {cfg.logdir} at step {controller.step}/{ccfg.steps}", flush=True)
        else:
            if cfg.warm_start == "scratch":
                phases.enter("warm start")
                controller.load_policy(_warm_start(cfg, model, tokenizer, controller, sft_cfg, rcfg))
            controller.save(wait=True)  # step 0: a resume starts from here
        if "heldout_before" not in state.data:
            if controller.step > 0:
                raise ConfigError(f"{cfg.logdir} holds RL step {controller.step} but no held-out result from "
                                  f"before RL; delete it to start over")
            phases.enter("held-out before")
            state.save(heldout_before=_evaluate(controller, tokenizer, cfg, rcfg, "before", data))
        before = state.data["heldout_before"]
        if "rl_summary" not in state.data or controller.step < ccfg.steps:
            phases.enter("RL")
            summary = asyncio.run(controller.run(on_step=_evaluation_during_rl(controller, tokenizer, cfg, data)))
            state.save(rl_summary=dict(summary, rewards=controller.metrics.rewards, step=controller.step,
                                       ledger_accounts=_ledger(controller, state), ers_moves=list(controller.moves),
                                       ers_refusal_last=controller.ers_history.refused,
                                       **({"mixture": _mixture_consumed(controller, mixed)} if mixed else {})))
        summary = state.data["rl_summary"]
        summary.setdefault("step", controller.step)  # a run_state.json from before these were kept
        summary.setdefault("ledger_accounts", _ledger(controller, state))
        phases.enter("held-out after")
        if controller.step < ccfg.steps:  # the run stopped early (e.g. the producer failed)
            raise RuntimeError(f"RL ended at step {controller.step} of {ccfg.steps}")
        after = _evaluate(controller, tokenizer, cfg, rcfg, "after", data)
        state.save(heldout_after=after)
        phases.enter("export")
        policy = _export(controller, tokenizer, os.path.join(cfg.logdir, "hf_export"))
        phases.enter("summary")
        compiles.stop()
        if not cluster.primary:
            return
        path = _report(cfg, ccfg, controller, summary, before, after, phases, compiles, platform,
                       dict(policy=f"{policy} (python launch/generate.py --checkpoint={policy})",
                            rollouts=", ".join(os.path.join(cfg.logdir, "rollouts", f) for f in (
                                "heldout_*.jsonl", *(["during_rl_step_*.jsonl"] if cfg.eval.get("every", 0) else []))),
                            config=config_file))
        state.save(finished=dict(steps=controller.step, summary=path))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`interrupts.install`)
        where, by = phases.current, interrupts.name()
        if where == "RL":
            _count_lost(controller, state)
        if cluster.multi:  # a save is collective: the processes were interrupted wherever each was
            # the save on disk once one in flight has finished (the other processes are still running, so a
            # collective save completes): the exit below would otherwise cut it at an unknown point
            latest = controller.checkpointer.settled_step() if controller.checkpointer is not None else None
            print(f"\ninterrupted by {by} in {where} at RL step {controller.step}/{ccfg.steps}: across processes "
                  f"nothing new is saved; the last checkpoint (step {latest}) in {cfg.logdir} resumes with the same "
                  f"command on every process", flush=True)
            cluster.interrupted(by)  # the others stop too, naming this process and the signal
            os._exit(130)
        print(f"\ninterrupted by {by} in {where} at RL step {controller.step}/{ccfg.steps}: saved in {cfg.logdir}; "
              f"run the same command to resume: {interrupts.command()}", flush=True)
        sys.exit(130)
    except ConfigError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - the user gets the error named, not a traceback
        import traceback
        if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") or isinstance(e, ConnectionError):
            cluster.await_peer_verdict()  # a collective that failed: a peer that died is the cause to name
        if phases.current == "RL":
            _count_lost(controller, state)
        trace = os.path.join(cfg.logdir, "error.log" if cluster.primary else f"error.process_{cluster.index}.log")
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


def _where(controller, platform: str) -> str:
    cluster = distributed.cluster()
    n = len(controller.backend.devices)
    return (f"{n * cluster.count} {platform} devices in {cluster.count} processes ({n} each)" if cluster.multi
            else f"{n} {platform} devices")


def _mixture_consumed(controller, mixed) -> dict:
    """The workload mixture the trainer consumed (its trained samples' classes) against the target."""
    from tiderl_jax.policies.misa_t import mixture_deviation

    trained = {cls: 0 for cls in mixed.target}
    for group, _ in controller.consumed:
        trained[mixed.class_of(group)] += 1
    return dict(target=dict(mixed.target), trained=trained, deviation=mixture_deviation(mixed.target, trained))


def _describe_tasks(cfg, data, too_long: int) -> str:
    if data is None:
        if cfg.mixture.get("target", ""):
            return f"tasks mixed {cfg.mixture.target} (mixture.*.kinds)"
        return f"tasks {', '.join(cfg.tasks)}"
    train = (f"train {cfg.data.train_files} ({len(data.train)} rows)" if data.train is not None
             else "train: the built-in tasks " + ", ".join(cfg.tasks))
    held = (f"held-out {cfg.data.heldout_files} ({len(data.heldout)} rows)" if not data.heldout_from_train
            else f"held-out {data.heldout_from_train} rows of the train files, not trained on")
    skipped = len(data.errors) + too_long
    return (f"{train}; {held}; reward {cfg.data.reward_fn}" + (f", environment {cfg.data.env}" if cfg.data.env else "")
            + (f"; {skipped} rows skipped ({len(data.errors)} malformed, {too_long} too long; the log names them)"
               if skipped else ""))


def _defaults() -> dict:
    """The config file's own values, before the command line's overrides (a run directory made before a key
    existed resumes while the key has its default: `run_state.config_changes`)."""
    from absl import flags
    from ml_collections import config_flags

    return config_lib.load_config_file(config_flags.get_config_filename(flags.FLAGS[_CONFIG.name])).to_dict()


def _num_params(model) -> int:
    import jax
    from flax import nnx
    return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


def _report(cfg, ccfg, controller, summary, before, after, phases, compiles, platform, files) -> str:
    """The summary table (printed) and summary.json (`tiderl_jax/run_report.py`); returns summary.json's path."""
    import jax

    from tiderl_jax import run_report
    from tiderl_jax.rl import stats
    from tiderl_jax.runtime import plots

    gains = {name: stats.paired_bootstrap(before[name]["rewards"], after[name]["rewards"], seed=cfg.seed)
             for name in before}
    metrics = controller.metrics
    png = metrics.plot_timeline(os.path.join(cfg.logdir, "timeline.png"), mode=ccfg.mode,
                                title=f"{controller.step} RL updates; the phases of this invocation above",
                                phases=phases.spans_on(metrics.clock))
    curves = plots.learning_curves(os.path.join(cfg.logdir, "metrics.jsonl"), before, after, gains,
                                   os.path.join(cfg.logdir, "learning.png"),
                                   during_tasks=cfg.eval.get("during_tasks", 0) if cfg.eval.get("every", 0) else 0)
    reward = plots.reward_curve(os.path.join(cfg.logdir, "metrics.jsonl"), os.path.join(cfg.logdir, "reward_curve.png"))
    phases.enter("done")
    total = sum(phases.seconds.values())
    files = dict(files, plots=f"{curves}, {reward}, {png}",
                 metrics=f"{cfg.logdir}/metrics.jsonl, TensorBoard: tensorboard --logdir {cfg.logdir}")
    rows = run_report.summary_rows(mode=ccfg.mode, rl=summary, batch_samples=ccfg.batch_samples, before=before,
                                   after=after, gains=gains, phases_s=phases.seconds, total_s=total,
                                   compiles=(compiles.count, compiles.seconds), files=files)
    print("\n" + run_report.format_table(rows), flush=True)
    out = run_report.summary_json(rl=summary, before=before, after=after, gains=gains, phases_s=phases.seconds,
                                  total_s=total, compiles=(compiles.count, compiles.seconds),
                                  devices=len(jax.devices()), platform=platform, files=files)
    path = os.path.join(cfg.logdir, "summary.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return path


if __name__ == "__main__":
    app.run(main)
