"""The OpenAI-compatible server under a bounded load on loopback, against the same requests in-process.

    python benchmarks/serving.py [--quick] [--json out.json]

The server is `launch/serve.py` over the shipped tiny policy (`checkpoints/tiny_agentic_sft`) in its own
process; the client (this process, the `openai` package's async client) sends streamed `/v1/completions`
requests (token-id prompts, fixed output lengths: `ignore_eos`, per-request seeds) with `concurrency` of them
in flight, for each concurrency of the sweep: a fixed number of requests under a time limit, after an untimed
pass. Both engines compile every shape bucket first (`--warmup`, `Engine.warmup`), so no compile is timed. Then this process runs the same requests (prompts, seeds, lengths)
through its own engine behind a `RolloutService` (`service.turn`, as the rollout loop calls it) at the same
concurrency: `in_process_tokens_per_s`. The two processes share the machine's cores, as a loopback server
and its clients do.

Per concurrency: requests/s, output tokens/s, TTFT p50 / p95 (request sent to the first streamed token), ITL
p50 / p95 (a request's time per output token after its first: (last chunk - first chunk) / (tokens - 1); the
engine emits up to `decode_steps` tokens per step, so chunks, not single tokens, arrive). The target: at the
highest concurrency the server's output tokens/s at most 15% below in-process (`overhead`).
JSON rows: concurrency, requests, requests_per_s, output_tokens_per_s, ttft_p50_s, ttft_p95_s, itl_p50_s,
itl_p95_s, in_process_tokens_per_s, overhead, and the engine steps each side took (`engine_steps`,
`in_process_engine_steps`: requests arriving one by one over HTTP make more, shorter steps than the same
requests submitted in the same instant).
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()

import numpy as np  # noqa: E402

CHECKPOINT = ROOT / "checkpoints" / "tiny_agentic_sft"
PAGE, NUM_PAGES, MAX_SEQ = 16, 4096, 2048  # launch/serve.py's engine without a config (the model's 2048 positions)


def requests(n: int, prompt_len: int, new: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [dict(prompt=rng.integers(0, 256, prompt_len).tolist(), new=new, seed=seed * 100_000 + i) for i in range(n)]


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "serve.py"), f"--checkpoint={CHECKPOINT}",
                             "--port=0", f"--num_pages={NUM_PAGES}", f"--max_seq_len={MAX_SEQ}", "--max_inflight=1024",
                             "--warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    deadline = time.time() + 1800  # --warmup: every shape bucket (minutes on a CPU, seconds from the compile cache)
    for line in proc.stdout:
        m = re.search(r"at (http://\S+/v1)", line)
        if m:  # the rest of its output is drained, never blocking it
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("the server did not start")


def server_steps(base_url: str) -> float:
    """The server's engine steps so far (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=30) as r:
        return float(re.search(r'tiderl_replica_steps\{replica="0"\} (\S+)', r.read().decode()).group(1))


async def over_http(client, reqs, concurrency: int, limit_s: float) -> dict:
    steps = server_steps(str(client.base_url))
    gate = asyncio.Semaphore(concurrency)
    results = []
    t0 = time.perf_counter()

    async def one(r):
        async with gate:
            if time.perf_counter() - t0 > limit_s:
                return
            sent = time.perf_counter()
            arrivals, usage = [], None
            stream = await client.completions.create(
                model="tiny_agentic_sft", prompt=r["prompt"], max_tokens=r["new"], temperature=1.0, seed=r["seed"],
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    arrivals.append(time.perf_counter())
                if chunk.usage is not None:
                    usage = chunk.usage
            n = usage.completion_tokens
            results.append(dict(ttft=arrivals[0] - sent, tokens=n,
                                itl=(arrivals[-1] - arrivals[0]) / (n - 1) if n > 1 else 0.0))
    await asyncio.gather(*(one(r) for r in reqs))
    seconds = time.perf_counter() - t0
    ttft, itl = [r["ttft"] for r in results], [r["itl"] for r in results]
    return dict(requests=len(results), engine_steps=server_steps(str(client.base_url)) - steps,
                requests_per_s=len(results) / seconds,
                output_tokens_per_s=sum(r["tokens"] for r in results) / seconds,
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p95_s=float(np.percentile(ttft, 95)),
                itl_p50_s=float(np.percentile(itl, 50)), itl_p95_s=float(np.percentile(itl, 95)))


async def in_process(service, reqs, concurrency: int) -> float:
    from tiderl_jax.engine.engine import Request
    from tiderl_jax.engine.sampling import SamplingParams

    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i, r):
        nonlocal tokens
        async with gate:
            sampling = SamplingParams(temperature=1.0, seed=r["seed"] % 2**31, max_new_tokens=r["new"])
            _, out = await service.turn(("bench", i), tokens=r["prompt"], cls="rlvr",
                                        submit=lambda eng: eng.submit(Request(r["prompt"], sampling)))
            tokens += len(out.new_tokens)
            service.end_session(("bench", i), "rlvr", len(out.tokens))
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return tokens / (time.perf_counter() - t0)


async def sweep(args, base_url) -> list[dict]:
    import openai

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.model.hf_io import load_hf_checkpoint
    from tiderl_jax.serving.service import RolloutService

    levels = (1, 4, 16) if args.quick else (1, 4, 16, 64)
    prompt_len, new = (128, 64) if args.quick else (256, 128)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    rows = []
    for c in levels:
        n = max(16, 4 * c)
        await over_http(client, requests(n, prompt_len, new, seed=1000 + c), c, args.limit_s)  # untimed: compiles
        row = dict(concurrency=c, **await over_http(client, requests(n, prompt_len, new, seed=c), c, args.limit_s))
        rows.append(row)
        print(f"[http] concurrency {c}: {row['output_tokens_per_s']:.0f} tokens/s, {row['requests_per_s']:.2f} req/s, "
              f"ttft p50 {row['ttft_p50_s']:.3f}s", flush=True)
    await client.close()
    engine = Engine(load_hf_checkpoint(CHECKPOINT), EngineConfig(page_size=PAGE, num_pages=NUM_PAGES, max_seq_len=MAX_SEQ))
    print(f"in-process warm-up took {engine.warmup():.0f}s", flush=True)
    service = RolloutService([engine])
    await service.start()
    try:
        for row in rows:
            c = row["concurrency"]
            reqs = requests(row["requests"], prompt_len, new, seed=c)
            await in_process(service, requests(len(reqs), prompt_len, new, seed=1000 + c), c)  # untimed
            steps = engine.stats()["steps"]
            row["in_process_tokens_per_s"] = await in_process(service, reqs, c)
            row["in_process_engine_steps"] = engine.stats()["steps"] - steps
            row["overhead"] = 1.0 - row["output_tokens_per_s"] / row["in_process_tokens_per_s"]
            print(f"[in-process] concurrency {c}: {row['in_process_tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        await service.stop()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--limit_s", type=float, default=300.0, help="time limit per concurrency level")
    args = p.parse_args()
    proc, base_url = start_server()
    try:
        rows = asyncio.run(sweep(args, base_url))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\n{'conc':>5}{'req/s':>8}{'out tok/s':>11}{'ttft p50':>10}{'ttft p95':>10}{'itl p50':>9}{'itl p95':>9}"
          f"{'in-proc tok/s':>15}{'overhead':>10}{'steps http/in-proc':>20}")
    for r in rows:
        print(f"{r['concurrency']:>5}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.0f}{r['ttft_p50_s']:>10.3f}"
              f"{r['ttft_p95_s']:>10.3f}{r['itl_p50_s']:>9.4f}{r['itl_p95_s']:>9.4f}{r['in_process_tokens_per_s']:>15.0f}"
              f"{r['overhead']:>10.1%}{r['engine_steps']:>12.0f} / {r['in_process_engine_steps']:<5.0f}")
    top = rows[-1]
    print(f"\nat concurrency {top['concurrency']}: the server's output tokens/s are {top['overhead']:.1%} below "
          f"in-process (target: at most 15%): {'met' if top['overhead'] <= 0.15 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
