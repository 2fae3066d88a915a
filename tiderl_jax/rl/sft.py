"""Supervised warm start: train the policy on the built-in tasks' demonstrations before RL.

A randomly initialised tiny model never completes a task, so every GRPO group has all-equal
rewards (zero advantage) and RL has nothing to learn from. A real post-training run starts from a
pretrained model that sometimes succeeds; here a short SFT phase plays that role.

```
tasks.make_task(kind, index, "train", seed) --tasks.demonstration--> chat messages
   --chat.encode--> ids + model_mask + image spans --> Trajectory(loss_mask = model tokens, images)
   --rl.batch.pack(patch_dim)--> PackedBatch --Trainer.sft_step--> token-mean NLL of the model tokens
```

The loss covers exactly the tokens the policy writes in a rollout (assistant turn bodies and their
closing `<|im_end|>`, see `chat.encode`), never the system / user prompt or the tool output, so the
demonstration teaches the behaviour RL later rewards and nothing else. The demonstration renders
the same ChatML as the rollout loop, so a trained turn looks exactly like a sampled one.

`warm_start` draws fresh train-split tasks every step (a deterministic index stream seeded by
`seed`: the same arguments give the same data), so the model learns the skill rather than memorising
a fixed set; held-out tasks are never touched here. Nothing here is task-specific beyond calling
`tasks.demonstration`.

Images (the `visual` task): a demonstration's images travel with it (`Trajectory.images`, patches of
the model's patch size, `tasks.image_patch_size`) and are packed with the model's `patch_dim`, so the
step trains the model tokens after an image on the same inputs a rollout gives it. A text-only model
asked to warm-start on a kind with images gets a ConfigError before any step.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Mapping, Sequence

from tiderl_jax.agents import tasks
from tiderl_jax.agents.env import Task
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.model import chat, vision
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.progress import Progress
from tiderl_jax.rl.batch import pack
from tiderl_jax.rl.trainer import Trainer

log = logging.getLogger(__name__)


def demonstration_trajectory(task: Task, tokenizer: Tokenizer, group: int = 0, *,
                             patch_size: int = 0, shortcut: bool = False) -> Trajectory:
    """The task's demonstration as a trajectory: its tokens, and the model tokens as the loss mask.

    A demonstration with images (the `visual` task) keeps them as the trajectory's `images`, cut into
    patches of `patch_size` (the model's: image_patch_dim = patch_size**2 * channels), each span on
    its `<|image_pad|>` placeholders at its absolute offset, as a rollout records them. `patch_size`
    0 stands for a text-only model: a task with images then raises ConfigError naming the problem.
    Log-probs and versions are placeholders (0.0 / -1): supervised steps do not read them.
    `shortcut`: the demonstrator's shortcut instead (`tasks.demonstration`).
    """
    encoded = chat.encode(tokenizer, tasks.demonstration(task, patch_size=patch_size, shortcut=shortcut))
    n = len(encoded.ids)
    return Trajectory(task.task_id, task.kind, group, tokens=list(encoded.ids),
                      loss_mask=list(encoded.model_mask), logprobs=[0.0] * n, model_logprobs=[0.0] * n,
                      versions=[-1] * n, images=list(encoded.images), reward=1.0, end_reason="answered")


def takes_shortcut(task: Task, rate: float) -> bool:
    """Whether the demonstrator takes its shortcut on `task`: for a share `rate` of the tasks of the kinds
    that have one (`tasks.SHORTCUT_KINDS`), chosen by a hash of the task id (the same data every run)."""
    return (rate > 0 and task.kind in tasks.SHORTCUT_KINDS
            and zlib.crc32(f"shortcut/{task.task_id}".encode()) < rate * 2**32)


def train_tasks(kinds: Sequence[str], start: int, count: int, seed: int) -> list[Task]:
    """`count` train-split tasks, kinds in turn, indices `start, start + 1, ...` of generator `seed`."""
    return [tasks.make_task(kinds[i % len(kinds)], i, "train", seed) for i in range(start, start + count)]


def warm_start(trainer: Trainer, tokenizer: Tokenizer, kinds: Sequence[str], num_steps: int,
               batch_size: int, seed: int = 0, log_every: int = 10, first_task: int = 0,
               progress: Progress | None = None, shortcut_rate: float = 0.0) -> list[float]:
    """`num_steps` SFT steps, each on `batch_size` fresh demonstrations; returns the NLL per step.

    `shortcut_rate`: the share of the demonstrations (of kinds that have one) in which the demonstrator
    takes its shortcut (`takes_shortcut`, `tasks.demonstration`): an imperfect demonstrator, whose
    policy RL then improves on; 0, every demonstration is the ideal one.

    Demonstrations with images are cut with the trainer's model's patch size and packed with its
    `patch_dim`, so the step feeds the model their patches as a rollout does; before any step, a
    kind with images and a model that cannot read them (text-only, another patch size, too few
    `max_image_patches`, another image token) is a ConfigError naming the problem, not a crash.

    Step i trains on tasks `first_task + i * batch_size, ...` of the stream, so a warm start split
    into several calls (passing on `first_task`) sees the same data as one call. With `progress`
    (the whole warm start's bar: global step / total, rate, ETA) each step updates it; otherwise it
    logs every `log_every` steps: the step, the mean NLL since the last line, steps/s and tokens/s
    (all tokens of the packed demonstrations, prompt included, as the forward pass computes them).
    """
    if not kinds or num_steps < 0 or batch_size < 1:
        raise ValueError(f"warm_start needs task kinds, num_steps >= 0 and batch_size >= 1; got "
                         f"kinds={list(kinds)}, num_steps={num_steps}, batch_size={batch_size}")
    cfg = trainer.config
    patch_size = tasks.image_patch_size(kinds, trainer.patch_dim)  # ConfigError: the model cannot see them
    model_cfg = trainer.model().cfg if patch_size else None
    curve: list[float] = []
    t_last, tokens_since = time.perf_counter(), 0
    step0 = first_task // batch_size
    for step in range(num_steps):
        demos = [demonstration_trajectory(t, tokenizer, patch_size=patch_size,
                                          shortcut=takes_shortcut(t, shortcut_rate))
                 for t in train_tasks(kinds, first_task + step * batch_size, batch_size, seed)]
        for demo in demos:
            if demo.images:
                _check_images(demo, model_cfg)
        packed = pack(demos, row_len=cfg.row_len, micro_rows=cfg.micro_rows, patch_dim=trainer.patch_dim)
        for i, reason in packed.dropped:
            log.warning("demonstration %s left out of the SFT step: %s", demos[i].task_id, reason)
        curve.append(trainer.sft_step(packed)["nll"])
        tokens_since += sum(len(demos[i].tokens) for i in packed.kept)
        if progress is not None:
            recent = curve[-min(len(curve), 10):]
            progress.update(step0 + step + 1, nll=sum(recent) / len(recent))
        elif (step + 1) % log_every == 0 or step + 1 == num_steps:
            now = time.perf_counter()
            recent = curve[-(step % log_every + 1):]
            log.info("sft step %d/%d: nll %.4f, %.2f steps/s, %.0f tokens/s", step + 1, num_steps,
                     sum(recent) / len(recent), len(recent) / (now - t_last), tokens_since / (now - t_last))
            t_last, tokens_since = now, 0
    return curve


def _check_images(demo: Trajectory, model_cfg) -> None:
    """ConfigError when the demonstration's images do not fit the model (`vision.check_images`): the
    same for every demonstration of its kind, so a configuration problem, not one to skip."""
    try:
        vision.check_images(demo.tokens, demo.images, model_cfg)
    except ValueError as e:
        raise ConfigError(f"the {demo.kind!r} demonstrations do not fit the model "
                          f"({demo.task_id}): {e}") from None


def warm_start_until(trainer: Trainer, tokenizer: Tokenizer, kinds: Sequence[str], max_steps: int, batch_size: int,
                     *, probe, target: float, min_steps: int = 0, probe_every: int = 25, seed: int = 0,
                     log_every: int = 10, log=print, progress: Progress | None = None,
                     on_probe=None, start: int = 0, shortcut_rate: float = 0.0) -> list[float]:
    """`warm_start` until `probe()` (the policy's success, sampled at the rollout temperature, on tasks the SFT
    does not train on) reaches `target`, checked every `probe_every` steps from `min_steps` on, and never past
    `max_steps` (benchmarks/learning.py's rule: the tool-call skill arrives abruptly, at a seed-dependent
    step, and GRPO learns only from groups whose rewards differ). `target` <= 0: `max_steps` steps, no
    probe. `progress` shows the global step over `max_steps`; `on_probe(step, success)` sees every probe.
    `start`: steps already taken (a resumed warm start goes on with the same data and probe schedule).
    `shortcut_rate`: `warm_start`'s.
    Returns the NLL of each step taken here."""
    curve: list[float] = []
    say = progress.print if progress is not None else log

    def done() -> int:
        return start + len(curve)
    while done() < max_steps:
        n = (min(probe_every - done() % probe_every, max_steps - done()) if target > 0
             else max_steps - done())
        curve += warm_start(trainer, tokenizer, kinds, n, batch_size, seed=seed, log_every=log_every,
                            first_task=done() * batch_size, progress=progress, shortcut_rate=shortcut_rate)
        if target <= 0 or done() < min_steps or done() >= max_steps:
            continue
        success = probe()
        say(f"warm start step {done()}/{max_steps}: sampled success on the probe tasks {success:.3f} "
            f"(stops at {target:.2f})")
        if on_probe is not None:
            on_probe(done(), success)
        if success >= target:
            break
    if progress is not None:
        progress.close()
    return curve


def warm_start_policy(model, tokenizer: Tokenizer, kinds: Sequence[str], sft: Mapping, trainer_config,
                      *, engine, load, rollout, seed: int = 0, on_probe=None, log=print, resume_dir: str | None = None):
    """The supervised warm start from `model`'s weights, as the main job and `launch/sft.py` run it.

    Trains on one device (faked CPU devices share the same cores: sharding the SFT over them adds only
    overhead) with `trainer_config` (the SFT's learning rate, row length and schedule), until the policy,
    loaded into `engine` by `load(params)` and sampled at the rollout temperature, solves `sft["target"]`
    of `sft["probe_tasks"]` probe tasks (another train stream, seed + 1) x `sft["probe_samples"]`
    (`warm_start_until`); `sft["steps"]` caps it. Shows a progress bar. With `resume_dir`, Ctrl-C saves the
    warm start there (weights, optimizer state, step) before it propagates, and a later call resumes
    from it. `sft["shortcut_rate"]` (0 when absent): the imperfect demonstrator's share of shortcuts
    (`warm_start`). Returns (params, NLL per step taken in this call)."""
    import dataclasses

    import jax
    from flax import nnx

    from tiderl_jax.rl import evaluate

    graphdef, params = nnx.split(model)
    single = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
    single.activation_sharding = None
    warm = Trainer(single, trainer_config)
    saver = None
    if resume_dir is not None:
        from tiderl_jax.rl.checkpoint import Checkpointer
        saver = Checkpointer(resume_dir, keep=1, async_save=False)
        if saver.latest_step() is not None:
            arrays, _ = saver.restore({"params": warm.params, "opt_state": warm.opt_state})
            warm.params, warm.opt_state = arrays["params"], arrays["opt_state"]
            warm.step_count = saver.latest_step()
            log(f"warm start: resumed at step {warm.step_count} from {resume_dir}")
    probe_tasks = train_tasks(kinds, 0, sft["probe_tasks"], seed + 1)
    sampled = dataclasses.replace(rollout, mode="request")

    def probe() -> float:
        load(warm.params)
        groups = evaluate.sample_groups(engine, tokenizer, probe_tasks, sft["probe_samples"], sampled)
        return sum(t.reward for t in groups) / len(groups)

    start = warm.step_count
    bar = Progress("warm start", sft["steps"], start=start, every=sft.get("log_every", 25))
    try:
        curve = warm_start_until(warm, tokenizer, kinds, sft["steps"], sft["batch_size"], probe=probe,
                                 target=sft["target"], min_steps=sft["min_steps"], probe_every=sft["probe_every"],
                                 seed=seed, log=log, progress=bar, start=start,
                                 shortcut_rate=sft.get("shortcut_rate", 0.0),
                                 on_probe=None if on_probe is None else lambda step, s: on_probe(step, s, warm.params))
    except KeyboardInterrupt:
        bar.close()
        if saver is not None and warm.step_count > start:
            saver.save(warm.step_count, {"params": warm.params, "opt_state": warm.opt_state}, {})
            saver.wait()
            log(f"warm start: saved at step {warm.step_count} in {resume_dir}")
        raise
    return warm.params, curve
