"""One RL step of a main-job config, decomposed by phase, against this machine's measured matmul limit.

    python benchmarks/rl_step.py [--quick] [--json out.json] [--configs tiny_agentic,smollm2_135m_gsm] [--steps N]

For each config (a file in configs/), a child process builds the main job exactly as `launch/train.py` does (same
typed configs, model, data, controller; no held-out evaluation, no checkpoints) and runs `--steps` RL updates; the
first is left out (it compiles), the others give each phase's median per step:

- `generation`: the rollout lane's busy seconds in the step; tokens computed are the engine's prefill and decode
  token slots (padded rows included), useful ones the prompt tokens it had to compute and the tokens it sampled;
- `proximal`, `reference`: the trainer's scoring passes (`reference` includes a decoupled pass on ref devices);
  0 when the pass was skipped (on-policy batch; no loss term reads the reference);
- `update`: the optimizer step (forward and backward over the packed micro-batches, then AdamW);
- `weight_sync`: the publish to the rollout; `waiting`: the trainer waiting for ready groups; `step`: the whole.

FLOPs are analytic: matmuls 2 x (matmul parameters) per token, causal attention 4 x heads x head_dim per (query,
key) pair per layer (the sequences' own pairs for the useful count; the packed rows' chunked-causal pairs for the
computed one, at the row length the trainer chose for the batch), a backward pass twice a forward. Generation counts matmuls only. `fraction_of_peak` is the useful
FLOP/s over the machine's matmul FLOP/s, measured in the same child after the run (float32 matmuls of 2,048^3 with
XLA on one device and with numpy's BLAS, the faster of the two). JSON rows: config, phase, seconds,
tokens_computed, tokens_useful, flops, fraction_of_peak (and peak_flops_per_s).
"""

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import ROOT, setup  # noqa: E402

PHASES = ("generation", "proximal", "reference", "update", "weight_sync", "waiting", "step")
# the SmolLM2 preset's batch cut for a benchmark step on 2 cores (the preset's own: 4 x 4 samples)
OVERRIDES = {"smollm2_135m_gsm": {"controller.groups_per_step": 2, "controller.group_size": 4}}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def matmul_peak() -> dict:
    """This machine's float32 matmul FLOP/s: XLA on one device and numpy's BLAS, best of five each."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    dot = jax.jit(jnp.dot)
    x = jax.device_put(a, jax.devices()[0])
    out = {}
    for name, fn in (("xla", lambda: dot(x, x).block_until_ready()), ("numpy", lambda: a @ a)):
        fn()
        best = min(_timed(fn) for _ in range(5))
        out[name] = 2 * n ** 3 / best
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(name: str, steps: int, out_path: str, sets: list[str]) -> None:
    setup()
    import logging as pylogging

    from absl import logging

    from tiderl_jax import config as config_lib
    from tiderl_jax.agents.env import LatencyModel
    from tiderl_jax.runtime.controller import Controller

    logging.set_verbosity(logging.INFO)
    pylogging.getLogger("absl").setLevel(pylogging.WARNING)
    cfg = _load(name)
    logdir = tempfile.mkdtemp(prefix=f"rl_step_{name}_")
    with cfg.unlocked():
        cfg.logdir = logdir
        cfg.controller.steps = steps
        cfg.controller.checkpoint_every = 0
        for key, value in [*OVERRIDES.get(name, {}).items(), *(x.split("=", 1) for x in sets)]:
            *path, field = key.split(".")
            node = cfg
            for part in path:
                node = node[part]
            kind = type(node[field])
            if isinstance(value, str):
                value = value.lower() in ("1", "true") if kind is bool else kind(value)
            node[field] = value
    config_lib.apply_platform_settings(cfg)
    ccfg, tcfg, ecfg, rcfg, _ = config_lib.rl_configs(cfg)
    data = config_lib.build_data(cfg)
    mixed = config_lib.build_mixture(cfg)
    _, rules, tokenizer, model = config_lib.build(cfg)
    controller = Controller(model, tokenizer, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                            trainer_config=tcfg, latency=LatencyModel(**cfg.latency.to_dict()), logdir=logdir,
                            rules=rules, task_source=(data and data.train) or mixed, make_env=data and data.make_env,
                            checkpoints=False)
    marks = []

    def mark(step):  # each step's cumulative lane seconds and engine counters, read after its publish
        stats = [e.stats() for e in controller.backend.engines]
        marks.append(dict(step=step, rollout=controller.metrics.busy_s["rollout"], ref=controller.metrics.busy_s["ref"],
                          **{k: sum(s.get(k, 0) for s in stats) for k in (
                              "prefill_slots", "decode_slots", "prefill_tokens_computed", "decode_tokens")}))
    mark(0)
    asyncio.run(controller.run(on_step=mark))
    rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
    peak = matmul_peak()
    matmul_params, per_pair = model.cfg.matmul_params, model.cfg.attention_flops_per_pair
    per_step = []
    for r, before, after in zip(rows, marks, marks[1:]):
        if r["step"] == 1:
            continue  # its programs compile
        computed = r.get("tokens_computed", 0.0)
        fwd_computed = 2 * matmul_params * computed + per_pair * r.get("attention_pairs_computed", 0.0)
        fwd_useful = 2 * matmul_params * r.get("tokens_real", 0.0) + per_pair * r.get("attention_pairs", 0.0)
        gen_useful = (after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
                      + after["decode_tokens"] - before["decode_tokens"])
        gen_computed = after["prefill_slots"] - before["prefill_slots"] + after["decode_slots"] - before["decode_slots"]
        prox = r.get("proximal_recomputed", 1.0) > 0
        ref = r.get("time_ref_s", 0.0) > 0 or after["ref"] > before["ref"]
        per_step.append({
            "generation": (after["rollout"] - before["rollout"], gen_computed, gen_useful, 2 * matmul_params * gen_useful,
                           2 * matmul_params * gen_computed),
            "proximal": (r.get("time_proximal_s", 0.0), computed if prox else 0, r.get("tokens_real", 0)
                         if prox else 0, fwd_useful if prox else 0.0, fwd_computed if prox else 0.0),
            "reference": (r.get("time_ref_s", 0.0) + after["ref"] - before["ref"], computed if ref else 0,
                          r.get("tokens_real", 0) if ref else 0, fwd_useful if ref else 0.0, fwd_computed if ref else 0.0),
            "update": (r.get("time_update_s", 0.0), computed, r.get("tokens_real", 0), 3 * fwd_useful,
                       3 * fwd_computed),
            "weight_sync": (r.get("sync_s", 0.0), 0, 0, 0.0, 0.0),
            "waiting": (r.get("trainer_wait_s", 0.0), 0, 0, 0.0, 0.0),
            "step": (r.get("step_time_s", 0.0), 0, r.get("tokens", 0), 0.0, 0.0),
        })
    limit = max(peak.values())
    drift = [(r["behaviour_logp_diff_mean"], r["behaviour_logp_diff_p99"]) for r in rows[1:]
             if "behaviour_logp_diff_mean" in r]  # on-policy batches that were scored anyway
    out = []
    for phase in PHASES:
        vals = [s[phase] for s in per_step]
        seconds, computed, useful, flops, flops_computed = (statistics.median(v[i] for v in vals) for i in range(5))
        out.append(dict(config=name, phase=phase, seconds=seconds, tokens_computed=computed, tokens_useful=useful,
                        flops=flops, flops_computed=flops_computed, fraction_of_peak=flops / seconds / limit if seconds > 0 and flops else 0.0,
                        peak_flops_per_s=limit, peak_xla=peak["xla"], peak_numpy=peak["numpy"], steps=len(per_step)))
        if phase == "proximal" and drift:  # the engine-vs-trainer |log-prob| difference on the same tokens
            out[-1].update(logp_diff_mean=statistics.median(d[0] for d in drift),
                           logp_diff_p99=statistics.median(d[1] for d in drift))
    with open(out_path, "w") as f:
        json.dump(out, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the main job's config only, 3 updates")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--configs", help="comma-separated config names (default: tiny_agentic, and smollm2_135m_gsm "
                                     "unless --quick)")
    p.add_argument("--steps", type=int, help="RL updates per config (the first is left out)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for every config (repeatable), e.g. controller.tensor=1")
    p.add_argument("--child", nargs=4, metavar=("CONFIG", "STEPS", "OUT", "SETS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2], json.loads(args.child[3]))
    names = (args.configs.split(",") if args.configs else
             ["tiny_agentic"] + ([] if args.quick else ["smollm2_135m_gsm"]))
    rows = []
    for name in names:
        steps = args.steps or (3 if args.quick or name != "tiny_agentic" else 8)
        env = dict(os.environ)  # the config sets its own device count (the SmolLM2 preset: one device)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags)
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            print(f"{name}: {steps} RL updates (the first compiles and is left out)", flush=True)
            subprocess.run([sys.executable, __file__, "--child", name, str(steps), tmp.name, json.dumps(args.set)],
                           env=env, check=True)
            rows += json.load(open(tmp.name))
    print(f"\nmatmul limit (float32, measured): XLA {rows[0]['peak_xla'] / 1e9:.0f} GFLOP/s, "
          f"numpy {rows[0]['peak_numpy'] / 1e9:.0f} GFLOP/s")
    print(f"{'config':<18} {'phase':<12} {'seconds':>8} {'tok computed':>13} {'tok useful':>11} {'GFLOP':>8} "
          f"{'of peak':>8}")
    for r in rows:
        print(f"{r['config']:<18} {r['phase']:<12} {r['seconds']:8.2f} {r['tokens_computed']:13.0f} "
              f"{r['tokens_useful']:11.0f} {r['flops'] / 1e9:8.1f} {100 * r['fraction_of_peak']:7.1f}%")
    for r in rows:
        if "logp_diff_mean" in r:
            print(f"{r['config']}: engine-vs-trainer |log-prob| difference on on-policy tokens: mean "
                  f"{r['logp_diff_mean']:.2e}, p99 {r['logp_diff_p99']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
