"""Mixed precision on SmolLM2-135M-Instruct: the engine's behaviour log-probs against the trainer's, per token.

    python benchmarks/mixed_precision.py [--quick] [--json out.json]

The packaged GGUF loaded twice, `model.dtype` float32 and bfloat16 (float32 master weights both:
`param_dtype=float32`), on one CPU device. Each samples 8 chat prompts (`--quick`: 4) at temperature 1 through the
engine (its KV pool in the compute dtype), then the trainer's forward (`rl/trainer.py`'s `token_logprobs`, the
same dtype) scores the same tokens. Per sampled token, |delta log p| = |trainer - engine|: the gap decoupled PPO's
weight w = min(pi_prox / pi_behav, tis_cap) absorbs (with the proximal log-probs the trainer's, w = exp(delta)).
Rows: `dtype, tokens, mean_abs_delta, p99_abs_delta, max_abs_delta, mean_abs_weight_minus_1, truncated_share`
(tokens whose w reached `tis_cap` = 2), and the engine's `decode_tokens_per_s` at this batch.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(1)

QUESTIONS = ("What is 17 + 25?", "Name three primary colors.", "Write a haiku about the sea.",
             "How many legs does a spider have?", "Explain what a prime number is.", "What is the capital of France?",
             "Sort these numbers: 5, 2, 9, 1.", "Give a synonym for 'happy'.")
TIS_CAP = 2.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 prompts, 24 new tokens")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import jax.numpy as jnp
    import numpy as np
    import smollm2  # tests/smollm2.py: the packaged GGUF

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.model.gguf_io import load_gguf
    from tiderl_jax.rl.trainer import token_logprobs

    questions, new = (QUESTIONS[:4], 24) if args.quick else (QUESTIONS, 48)
    rows = []
    print(f"{'dtype':>9} {'tokens':>6} {'mean |d|':>9} {'p99 |d|':>8} {'max |d|':>8} {'mean |w-1|':>10} "
          f"{'truncated':>9} {'decode tok/s':>12}")
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_gguf(smollm2.gguf_path(), dtype=dtype, param_dtype="float32")
        prompts = [tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")  # its ChatML
                   for q in questions]
        engine = Engine(model, EngineConfig(page_size=16, num_pages=256, max_seq_len=256, max_running=len(prompts)))
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)  # no stop ids: every token
        engine.generate(prompts, sampling)  # compiles
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        rate = len(prompts) * new / (time.perf_counter() - t0)
        deltas = []
        for prompt, o in zip(prompts, out):
            tokens = jnp.asarray([o.tokens], jnp.int32)
            logp, _ = token_logprobs(model, tokens, jnp.arange(tokens.shape[1])[None], jnp.ones_like(tokens), 1.0)
            trainer = np.asarray(logp[0, len(prompt):], np.float64)
            deltas.extend(trainer - np.asarray(o.logp_sample[len(prompt):], np.float64))
        d = np.asarray(deltas)
        w = np.minimum(np.exp(d), TIS_CAP)
        row = dict(dtype=dtype, tokens=int(d.size), mean_abs_delta=float(np.abs(d).mean()),
                   p99_abs_delta=float(np.quantile(np.abs(d), 0.99)), max_abs_delta=float(np.abs(d).max()),
                   mean_abs_weight_minus_1=float(np.abs(w - 1).mean()), truncated_share=float((w >= TIS_CAP).mean()),
                   decode_tokens_per_s=rate)
        rows.append(row)
        print(f"{dtype:>9} {row['tokens']:>6} {row['mean_abs_delta']:>9.4f} {row['p99_abs_delta']:>8.4f} "
              f"{row['max_abs_delta']:>8.4f} {row['mean_abs_weight_minus_1']:>10.4f} {row['truncated_share']:>9.4f} "
              f"{rate:>12.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
