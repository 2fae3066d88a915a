"""One script for a GPU's or TPU's few minutes: parity, engine speed against the memory roofline, train-step MFU.

    python benchmarks/accelerator_check.py [--json out.json] [--quick] [--on_cpu]

On a GPU or TPU (JAX's default backend), in at most ~8 minutes, rows of:
- `limits`: the device's measured limits, in this run: bfloat16 matmul FLOP/s (8192^2, best of 5) and memory
  bandwidth (a 1 GiB copy: read + write bytes per second, best of 5), and `device_kind`;
- `kernels`: the attention implementations `auto` takes here for SmolLM2's shape: the engine's
  (`engine/paged_attention.py`) and the train step's (`rl/trainer_config.py`);
- `parity`: SmolLM2-135M-Instruct (the packaged GGUF; a random model of its shape when it is not installed)
  greedy through the engine on the accelerator against the reference generator on the CPU, float32 both:
  the share of prompts whose tokens are identical, and the first position they differ at otherwise;
- `decode`: the engine's decode tokens/s at a batch of 32 (bfloat16), and its fraction of the memory roofline
  (each decode step reads every weight and the batch's KV cache once: batch x bandwidth / bytes per step), with
  `auto`'s attention and with the `xla` path (the kernel's effect, in one run);
- `train`: the train step's seconds and MFU (6 x parameters x trained tokens + attention, over the measured matmul
  peak) on SmolLM2-135M's shape and on Qwen2.5-0.5B's shape, random weights, bfloat16 compute.

On a CPU it says there is no accelerator and exits 0 (`--on_cpu` runs it anyway with small sizes: how the test
checks the script). The numbers go in the issue's note; nothing else depends on them.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import ROOT, best_of  # noqa: E402  (the repository on the import path; the platform is JAX's own choice)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def limits(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n = 1024 if quick else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    dot = jax.jit(lambda x: x @ x)
    flops = 2 * n ** 3 / best_of(lambda: dot(a).block_until_ready())
    size = (64 if quick else 1024) * 2 ** 20 // 4
    x = jnp.ones((size,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    bandwidth = 2 * x.nbytes / best_of(lambda: copy(x).block_until_ready())
    return dict(check="limits", device_kind=jax.devices()[0].device_kind, platform=jax.default_backend(),
                matmul_flops=flops, bandwidth_bytes_per_s=bandwidth)


def smollm2(dtype: str):
    """SmolLM2-135M-Instruct from its packaged GGUF, else a random model of its shape: (model, source)."""
    from tiderl_jax.model import packaged
    from tiderl_jax.model.config import ConfigError
    from tiderl_jax.model.decoder import init_decoder
    from tiderl_jax.model.gguf_io import load_gguf

    try:
        model, _ = load_gguf(packaged.model_path("smollm2-135m-instruct"), dtype=dtype, param_dtype="float32")
        return model, "packaged GGUF"
    except ConfigError:
        return (init_decoder(dataclasses.replace(packaged.SMOLLM2_135M_SHAPE, dtype=dtype), seed=0),
                "random (GGUF not installed)")


def parity(quick: bool) -> dict:
    import jax
    import numpy as np

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.model.generate import generate

    model, source = smollm2("float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(8, 40, 4 if quick else 8)]
    new = 8 if quick else 32
    engine = Engine(model, EngineConfig(num_pages=256, max_seq_len=128))
    got = [o.new_tokens for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        from flax import nnx
        graphdef, params = nnx.split(model)
        ref_model = nnx.merge(graphdef, jax.device_put(params, cpu))
        want = generate(ref_model, prompts, max_new_tokens=new, temperature=0.0).tokens
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    return dict(check="parity", model=source, prompts=len(prompts), new_tokens=new,
                identical=sum(f is None for f in first) / len(prompts),
                first_difference=[f for f in first if f is not None])


def decode(quick: bool, lim: dict, attention_impl: str = "auto") -> dict:
    import jax
    import numpy as np

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.engine.sampling import SamplingParams

    model, source = smollm2("float32" if quick else "bfloat16")
    batch, new, prompt = (4, 16, 16) if quick else (32, 256, 128)
    engine = Engine(model, EngineConfig(num_pages=batch * (prompt + new) // 16 + 64, max_seq_len=prompt + new + 16,
                                        max_running=batch, attention_impl=attention_impl))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, model.cfg.vocab_size, prompt).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    engine.generate(prompts, sp)  # compiles
    t0 = time.perf_counter()
    engine.generate(prompts, sp)
    seconds = time.perf_counter() - t0
    cfg = model.cfg
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    step_bytes = weight_bytes + batch * (prompt + new / 2) * kv_per_token  # the mean context over the decode
    roofline = batch * lim["bandwidth_bytes_per_s"] / step_bytes
    tokens_per_s = batch * new / seconds
    return dict(check="decode", model=source, dtype=cfg.dtype, batch=batch, new_tokens=new,
                attention_impl=engine.runner.impl,
                tokens_per_s=tokens_per_s, roofline_tokens_per_s=roofline, fraction_of_roofline=tokens_per_s / roofline)


def nnx_state(model):
    from flax import nnx
    return nnx.split(model)[1]


def train(quick: bool, lim: dict) -> list[dict]:
    import jax

    from tiderl_jax.model.config import ModelConfig
    from tiderl_jax.model.decoder import init_decoder
    from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE as SMOLLM2
    from tiderl_jax.rl.trainer import LOGIT_SLICE, Trainer
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.trajectory import Trajectory

    qwen05 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, attention_bias=True, tie_word_embeddings=True,
                         rope_theta=1000000.0, dtype="bfloat16", param_dtype="float32")
    cases = [("smollm2_135m_shape", dataclasses.replace(SMOLLM2, dtype="bfloat16"))]
    if quick:
        cases = [("smollm2_2_layers", dataclasses.replace(SMOLLM2, num_layers=2, dtype="float32"))]
    else:
        cases.append(("qwen2_5_0_5b_shape", qwen05))
    rows = []
    row_len, n_rows = (128, 2) if quick else (1024, 8)
    for name, cfg in cases:
        trainer = Trainer(init_decoder(cfg, seed=0), TrainerConfig(row_len=row_len, micro_rows=n_rows,
                                                                   learning_rate=1e-6, total_steps=100))
        batch = []
        for i in range(n_rows):
            t = Trajectory(f"t{i}", "check", i // 2, reward=float(i % 2))
            t.extend([5] * (row_len // 4), generated=False)
            n = row_len - row_len // 4
            t.extend([7] * n, generated=True, logprobs=[-1.0] * n, model_logprobs=[-1.0] * n, versions=[0] * n)
            batch.append(t)
        trainer.rl_step(batch)  # compiles
        jax.block_until_ready(trainer.params)
        t0 = time.perf_counter()
        trainer.rl_step(batch)
        jax.block_until_ready(trainer.params)
        seconds = time.perf_counter() - t0
        tokens = n_rows * row_len
        attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n_rows * row_len * row_len  # fwd + bwd
        flops = 6 * cfg.num_params * tokens + attention
        rows.append(dict(check="train", model=name, dtype=cfg.dtype, tokens=tokens, seconds=seconds,
                         flops=flops, mfu=flops / seconds / lim["matmul_flops"], logit_slice=LOGIT_SLICE))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="small sizes (what --on_cpu uses)")
    p.add_argument("--on_cpu", action="store_true", help="run on the CPU anyway (checks the script itself)")
    args = p.parse_args()
    import jax

    from tiderl_jax.engine.paged_attention import resolve_impl
    from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE
    from tiderl_jax.rl.trainer_config import TrainerConfig, train_attention

    platform = jax.default_backend()
    if platform == "cpu" and not args.on_cpu:
        print("no accelerator: JAX's default backend is the CPU (install jax[cuda12] or jax[tpu] into .venv: "
              "docs/running.md); nothing to check")
        return
    quick = args.quick or platform == "cpu"
    t0 = time.perf_counter()
    lim = limits(quick)
    shape = dict(head_dim=SMOLLM2_135M_SHAPE.head_dim, page_size=16)
    rows = [lim, dict(check="kernels", platform=platform,
                      engine_attention_auto_float32=resolve_impl("auto", dtype="float32", **shape),
                      engine_attention_auto_bfloat16=resolve_impl("auto", dtype="bfloat16", **shape),
                      train_attention_auto=train_attention(TrainerConfig()))]
    for part in (lambda: [parity(quick)], lambda: [decode(quick, lim), decode(quick, lim, "xla")],
                 lambda: train(quick, lim)):
        for row in part():
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    print(f"accelerator check: {len(rows)} rows in {time.perf_counter() - t0:.0f} s on {lim['device_kind']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
