"""Supervised warm start: train the policy on the built-in tasks' demonstrations before RL.

A randomly initialised tiny model never completes a task, so every GRPO group has all-equal
rewards (zero advantage) and RL has nothing to learn from. A real post-training run starts from a
pretrained model that sometimes succeeds; here a short SFT phase plays that role.

```
tasks.make_task(kind, index, "train", seed) --tasks.demonstration--> chat messages
   --chat.encode--> ids + model_mask --> Trajectory(loss_mask = model tokens)
   --rl.batch.pack--> PackedBatch --Trainer.sft_step--> token-mean NLL of the model tokens
```

The loss covers exactly the tokens the policy writes in a rollout (assistant turn bodies and their
closing `<|im_end|>`, see `chat.encode`), never the system / user prompt or the tool output, so the
demonstration teaches the behaviour RL later rewards and nothing else. The demonstration renders
the same ChatML as the rollout loop, so a trained turn looks exactly like a sampled one.

`warm_start` draws fresh train-split tasks every step (a deterministic index stream seeded by
`seed`: the same arguments give the same data), so the model learns the skill rather than memorising
a fixed set; held-out tasks are never touched here. Nothing here is task-specific beyond calling
`tasks.demonstration`.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from tiderl_jax.agents import tasks
from tiderl_jax.agents.env import Task
from tiderl_jax.agents.trajectory import Trajectory
from tiderl_jax.model import chat
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.rl.batch import pack
from tiderl_jax.rl.trainer import Trainer

log = logging.getLogger(__name__)


def demonstration_trajectory(task: Task, tokenizer: Tokenizer, group: int = 0) -> Trajectory:
    """The task's demonstration as a trajectory: its tokens, and the model tokens as the loss mask.

    Log-probs and versions are placeholders (0.0 / -1): supervised steps do not read them.
    """
    encoded = chat.encode(tokenizer, tasks.demonstration(task))
    if encoded.images:
        raise ValueError(f"the {task.kind!r} demonstration carries images; demonstration_trajectory "
                         f"builds text-only trajectories")
    n = len(encoded.ids)
    return Trajectory(task.task_id, task.kind, group, tokens=list(encoded.ids),
                      loss_mask=list(encoded.model_mask), logprobs=[0.0] * n, model_logprobs=[0.0] * n,
                      versions=[-1] * n, reward=1.0, end_reason="answered")


def train_tasks(kinds: Sequence[str], start: int, count: int, seed: int) -> list[Task]:
    """`count` train-split tasks, kinds in turn, indices `start, start + 1, ...` of generator `seed`."""
    return [tasks.make_task(kinds[i % len(kinds)], i, "train", seed) for i in range(start, start + count)]


def warm_start(trainer: Trainer, tokenizer: Tokenizer, kinds: Sequence[str], num_steps: int,
               batch_size: int, seed: int = 0, log_every: int = 10, first_task: int = 0) -> list[float]:
    """`num_steps` SFT steps, each on `batch_size` fresh demonstrations; returns the NLL per step.

    Step i trains on tasks `first_task + i * batch_size, ...` of the stream, so a warm start split
    into several calls (passing on `first_task`) sees the same data as one call. Logs every
    `log_every` steps: the step, the mean NLL since the last line, steps/s and tokens/s (all
    tokens of the packed demonstrations, prompt included, as the forward pass computes them).
    """
    if not kinds or num_steps < 0 or batch_size < 1:
        raise ValueError(f"warm_start needs task kinds, num_steps >= 0 and batch_size >= 1; got "
                         f"kinds={list(kinds)}, num_steps={num_steps}, batch_size={batch_size}")
    cfg = trainer.config
    curve: list[float] = []
    t_last, tokens_since = time.perf_counter(), 0
    for step in range(num_steps):
        demos = [demonstration_trajectory(t, tokenizer)
                 for t in train_tasks(kinds, first_task + step * batch_size, batch_size, seed)]
        packed = pack(demos, row_len=cfg.row_len, micro_rows=cfg.micro_rows)
        for i, reason in packed.dropped:
            log.warning("demonstration %s left out of the SFT step: %s", demos[i].task_id, reason)
        curve.append(trainer.sft_step(packed)["nll"])
        tokens_since += sum(len(demos[i].tokens) for i in packed.kept)
        if (step + 1) % log_every == 0 or step + 1 == num_steps:
            now = time.perf_counter()
            recent = curve[-(step % log_every + 1):]
            log.info("sft step %d/%d: nll %.4f, %.2f steps/s, %.0f tokens/s", step + 1, num_steps,
                     sum(recent) / len(recent), len(recent) / (now - t_last), tokens_since / (now - t_last))
            t_last, tokens_since = now, 0
    return curve


def warm_start_until(trainer: Trainer, tokenizer: Tokenizer, kinds: Sequence[str], max_steps: int, batch_size: int,
                     *, probe, target: float, min_steps: int = 0, probe_every: int = 25, seed: int = 0,
                     log_every: int = 10, log=print) -> list[float]:
    """`warm_start` until `probe()` (the policy's success, sampled at the rollout temperature, on tasks the SFT
    does not train on) reaches `target`, checked every `probe_every` steps from `min_steps` on, and never past
    `max_steps` (benchmarks/learning.py's rule: the tool-call skill arrives abruptly, at a seed-dependent
    step, and GRPO learns only from groups whose rewards differ). `target` <= 0: `max_steps` steps, no
    probe. Returns the NLL per step."""
    curve: list[float] = []
    while len(curve) < max_steps:
        n = min(probe_every, max_steps - len(curve)) if target > 0 else max_steps
        curve += warm_start(trainer, tokenizer, kinds, n, batch_size, seed=seed, log_every=log_every,
                            first_task=len(curve) * batch_size)
        if target <= 0 or len(curve) < min_steps or len(curve) >= max_steps:
            continue
        success = probe()
        log(f"warm start step {len(curve)}: sampled success {success:.3f} (target {target:.2f})")
        if success >= target:
            break
    return curve
