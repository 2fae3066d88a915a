"""The main job's CPU default: supervised warm start, then TideRL GRPO on built-in agentic tasks.

A 0.84M-parameter Qwen3-style model (configs/tiny.py's family at hidden 128: a train step is ~6x
cheaper than the 3.25M tiny model's, which is what fits warm start + RL into ~13 minutes on two
cores: the warm start stopped at 550 of its 800 steps in a measured run, 773 s in all;
benchmarks/learning.py uses the same size) on 4 faked CPU devices cut into device groups of 1:
rollout 2 groups, each its own one-device engine replica behind the router (`rollout_replicas="group"`),
train 2 groups (2 devices, fsdp, no tensor parallelism), no reference group and no reference model at
all: the loss has no KL term, so no reference pass runs. ERS moves whole groups between rollout and train.

Why this layout, measured on the 2-core machine it is for (the faked devices share the two cores, so
a layout changes overheads, never the compute there is): a one-device engine runs the paged attention as
the C++ kernel (engine/cpu_attention.py; a sharded engine runs XLA's), and `benchmarks/rl_step.py
--configs tiny_agentic --steps 6` measured the step at 11.9 s with this layout against 16.0 s with the
earlier one (8 devices in groups of 2, replicas of 2 devices): generation 16.7 s of lane time against
31.6 s, the trainer no longer waiting for rollouts (0.0 s against 8.7 s). The update of a 64-sample batch
took 5.3 s with fsdp on 2 devices and 6.3-6.9 s tensor-parallel on 4, hence no tensor parallelism.

The update's schedule: a constant learning rate of 1e-5 for 40 updates (veRL's actor default is constant; no
warm-up). Measured with `make run ARGS="--config.controller.steps=40 --config.trainer.learning_rate=LR"` on
seed 0 (the held-out greedy gain with its paired 95% interval): 1e-5 +0.141 [+0.070, +0.211]; 3e-5 +0.078
[-0.008, +0.164] (+0.055 with Adam's b1 at 0.98); 1e-4 +0.055 [-0.024, +0.133]. At 16 updates 3e-5 had gained
+0.117, +0.102 and +0.078 on seeds 0, 1, 2, all of it within the first four updates (seed 0's evaluation
during RL held still after them), and 3e-4 collapsed the policy (-0.250 and -0.430 on seeds 0 and 1). Why so
small a rate: an update of 64 samples carries little signal, and a larger step spends it on the failures and
erodes the copying both tasks rest on. One update at 1e-4 moved the sequence log-prob of the
positive-advantage samples by +0.21 nats and of the negative ones by -1.45 (a failed sample's unlikely tokens
have the largest gradients); in a sync GRPO loop from the same checkpoint at 3e-4, greedy calculator fell from
40 to 2 of 64 in 8 updates (the replies mis-copy the tool's result), and it fell too with 256 samples per
update (to 20 in 10 updates) and with a KL term of 0.1 (to 9 in 20). At 1e-5 the gain builds over the 40
updates instead. (These measurements started from stage 1 of the shipped warm start, below.)

What RL has to learn: the shipped warm start (checkpoints/README.md) ends with 450 steps on an imperfect
demonstrator that skips its last tool call in 60% of its demonstrations (lookup answers the city after one
search; calculator replies without the tool). Greedy decoding follows that majority, so RL's task is a choice, the
tool call that earns the reward, which its sparse reward can teach. From stage 1 alone (the ideal demonstrator)
the greedy gain was +0.125, +0.102 and +0.094 on seeds 0, 1, 2 and the sampled gain nothing: the failures left
were copy errors of the byte-level model, which no rate above improved. With a stage 2 of 150 steps it was
+0.172, +0.195 and +0.180 (rollouts at temperature 1), lookup stopping at 24-27 of 64 after RL, about stage 1's
copying; the 300 further steps copy better. Seed 0 from the shipped policy: greedy 57 -> 88 of 128 (+0.242
[+0.164, +0.320]; lookup 21 -> 33, calculator 36 -> 55), sampled 32 -> 63.

Rollouts sample at temperature 0.7. From the 150-step stage 2, seed 0: at 1.0 the greedy gain was +0.172, the
mean reward of all samples drawn rose by +0.041 from the first quarter of the updates to the last, and half the
groups were dropped as all-equal (50-59% on seeds 0-2, medians per update); at 0.7, +0.172, +0.119 and 37%. At
temperature 1 the byte-level model mis-copies more of its samples: noise that teaches nothing and leaves groups
all-zero, which dynamic sampling then samples again. The held-out evaluation's sampled mode samples at this
temperature.

The held-out evaluation during RL runs every 8 updates: each stalls its update by 4-6 s (seed 0's median step was
8.6 s with one every 4 updates, 7.2 s over the steps without one).

The engine's prefill calls compute the padded [rows, width] block (`engine.ragged_prefill=False`): packing them
(ragged) adds 11 programs to the engine's 27, and `benchmarks/engine_warmup.py` measured the cold warm-up at 81.7 s
with them against 53.0 s without, for a model whose prefills are a small share of its rollout time.

Dynamic sampling (`controller.filter_groups`, DAPO): a group whose 8 rewards are all equal is dropped and
replaced, so every update trains on 8 informative groups; that costs rollout (a median of 22-30% of the sampled
groups per update are dropped on seeds 0-2). Environment latency is real waiting (log-normal, median 0.3 s). Every key
can be overridden with `--config.x.y=v`.
"""

import importlib.util
import pathlib

from tiderl_jax.config import main_job_sections

_spec = importlib.util.spec_from_file_location("tiny", pathlib.Path(__file__).with_name("tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


def get_config():
    c = tiny.get_config()
    c.model.update(hidden_size=128, intermediate_size=384, head_dim=32)
    c.mesh.update(data=1, fsdp=-1, tensor=1)  # no tensor parallelism (module docstring)
    # every section launch/train.py reads, at its default (tiderl_jax/config.py, main_job_sections); the main
    # job's values below. --config.data.train_files=FILE trains on a dataset instead (docs/data.md)
    main_job_sections(c, logdir="runs/tiny_agentic")
    c.tasks = ("calculator", "lookup")
    # RL starts from the shipped warm-started policy (checkpoints/README.md says how it was made);
    # "scratch" runs the supervised warm start first, from random weights (launch/sft.py's rule)
    c.warm_start = "checkpoint"
    c.checkpoint = "checkpoints/tiny_agentic_sft"
    c.eval.update(tasks=128, every=8, during_tasks=32)  # every 8 updates: 5 points of the curve during RL
    c.cpu_devices = 4
    c.controller.update(mode="tiderl", steps=40, groups_per_step=8, group_size=8, eta=1, max_concurrent=128,
                        device_group_size=1, rollout_groups=2, ref_groups=0, train_groups=2, tensor=1,
                        rollout_replicas="group",
                        ers_patience=2, ers_cooldown=3, checkpoint_every=5, filter_groups=True)
    c.engine.update(page_size=16, num_pages=2048, max_seq_len=1024, max_running=64, prefill_chunk=512,
                    prefill_budget=2048, max_prefill_rows=4, decode_steps=8, bucket_growth=4, ragged_prefill=False)
    c.rollout.update(max_turns=4, max_new_tokens=96, max_context=1024, temperature=0.7)
    c.trainer.update(learning_rate=1e-5, lr_schedule="constant", warmup_steps=0, row_len=1024, micro_rows=8, grad_clip=1.0, weight_decay=0.0)
    c.loss.update(advantage_estimator="grpo", kl_coef=0.0, clip_low=0.2, clip_high=0.28)
    return c
