"""Continuous Task Batching vs the request-level baseline on an agentic workload, in one run.

    python benchmarks/ctb.py [--quick] [--json out.json]

Workload: 64 tasks (calculator and lookup, alternating; 24 with --quick) on the tiny CPU model
(configs/tiny.py's dimensions, random weights until the SFT warm start exists, so every task runs
all its turns: the environments send an answer without a tool call back), up to 8 turns of up to
32 new tokens, environment latency log-normal with median 0.3 s and sigma 1.0 (heavy tail, real
waiting), a KV pool holding about half of the concurrent tasks' final contexts. Both policies run
the same tasks on the same engine configuration after a shared warm-up (every shape compiled).
JSON rows: policy, kv_hit_rate, prefill_tokens, rollout_tokens_per_s, tasks_completed,
mean_reward (+ evictions, preemptions, wall_s).
"""

import argparse
import asyncio
import json
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()

from tiderl_jax.agents import tasks as T  # noqa: E402
from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402

TINY = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=2048)
LATENCY = LatencyModel(median_s=0.3, sigma=1.0, max_s=5.0)
MAX_TURNS, NEW_TOKENS, PAGE = 8, 32, 16


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    n = 24 if args.quick else 64
    tasks = [(T.make_task("calculator" if i % 2 == 0 else "lookup", i // 2), i) for i in range(n)]
    tok = Tokenizer.builtin()
    model = init_decoder(TINY, seed=0)
    # A task's final context: prompt (~110) + 8 turns x (32 generated + ~110 observation) ~ 1,250.
    full_context = 1250
    pages = n * full_context // 2 // PAGE
    config = EngineConfig(page_size=PAGE, num_pages=pages, max_seq_len=2048, max_running=64,
                          prefill_chunk=512, prefill_budget=2048, max_prefill_rows=16, decode_steps=8)
    print(f"{n} tasks, KV pool {pages} pages = {pages * PAGE} tokens (~half of {n} x {full_context})",
          flush=True)
    warm = Engine(model, config)
    print(f"warm-up: {warm.num_programs()} programs, {warm.warmup():.1f}s", flush=True)
    rows = []
    for policy in ("ctb", "request"):
        engine = Engine(model, config)
        runner = RolloutRunner(engine, tok, RolloutConfig(mode=policy, max_turns=MAX_TURNS,
                                                          max_new_tokens=NEW_TOKENS, temperature=1.0,
                                                          max_context=2048, seed=0))
        t0 = time.perf_counter()
        trajs = asyncio.run(runner.run(tasks, lambda t: T.make_env(t, latency=LATENCY,
                                                                   seed=zlib.crc32(t.task_id.encode()))))
        wall = time.perf_counter() - t0
        st = engine.stats()
        gen = sum(t.num_generated for t in trajs)
        rows.append(dict(policy=policy, kv_hit_rate=st["prefix_hit_rate"],
                         prefill_tokens=st["prefill_tokens_computed"], rollout_tokens_per_s=gen / wall,
                         tasks_completed=sum(t.failure is None for t in trajs),
                         mean_reward=sum(t.reward for t in trajs) / len(trajs),
                         evictions=runner.metrics["ctb_evictions"], preemptions=st["preemptions"],
                         wall_s=wall))
        print(f"[{policy}] {rows[-1]}", flush=True)
    ctb_row, req_row = rows
    print(f"\n{'policy':<9}{'hit rate':>10}{'prefill tok':>13}{'tokens/s':>10}{'completed':>11}"
          f"{'reward':>8}{'evict':>7}{'preempt':>9}{'wall s':>8}")
    for r in rows:
        print(f"{r['policy']:<9}{r['kv_hit_rate']:>10.3f}{r['prefill_tokens']:>13}"
              f"{r['rollout_tokens_per_s']:>10.0f}{r['tasks_completed']:>11}{r['mean_reward']:>8.3f}"
              f"{r['evictions']:>7}{r['preemptions']:>9}{r['wall_s']:>8.1f}")
    print(f"\nCTB / request-level: hit rate {ctb_row['kv_hit_rate'] / max(req_row['kv_hit_rate'], 1e-9):.2f}x, "
          f"rollout throughput {ctb_row['rollout_tokens_per_s'] / req_row['rollout_tokens_per_s']:.2f}x, "
          f"prefill tokens {ctb_row['prefill_tokens'] / max(1, req_row['prefill_tokens']):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
