"""GRPO from a supervised warm start raises held-out success on the `calculator` task (tiny CPU model).

    python benchmarks/learning.py [--quick] [--seeds 0 1 ...] [--json out.json] [--plot out.png]

Per seed, on one CPU device (faked devices share the same cores and add only overhead here):
1. **Model**: a 1.0M-parameter Qwen3-style decoder (hidden 128, 4 layers, vocab 384 of the built-in
   byte tokenizer), smaller than configs/tiny.py's 3.25M: a supervised step is ~6x faster, which
   is what lets the warm start and 60 GRPO iterations fit this 2-core machine.
2. **Warm start** (`rl/sft.py`): SFT on fresh calculator demonstrations (the task's solver: call
   `calc` with the expression, answer with its output). Copying the expression into the tool call is
   the hard part, and the model learns it abruptly (an exploratory run, seed 0, lr 3e-3: held-out
   greedy success 0 after 200 steps, 0.27 after 300, 0.97 after 400). So the warm start stops
   inside that transition: once success at the rollout temperature on 32 train tasks x 4 samples
   (another seed's tasks, never trained on) reaches 0.1, probed every 10 steps from step 200 on.
   The policy then "sometimes succeeds", as a pretrained model would, and most GRPO groups have
   reward variance. (Sampled, not greedy: early in the transition greedy success runs far ahead of
   sampled success, and GRPO learns from sampled groups.)
3. **Held-out success before**: the first `heldout_tasks` tasks of the held-out split (generator
   seed 0; no training step draws from it), `heldout_samples` rollouts each at the rollout
   temperature (the policy GRPO optimises), and greedy as an extra. Reward is 1 for the right number.
4. **GRPO**: each iteration rolls out `group_size` samples of `tasks_per_iteration` fresh train
   tasks (the train stream continues after the SFT's tasks, so none is seen twice) through the
   engine at temperature 1 (multi-turn, real tools), takes one `Trainer.rl_step` (GRPO advantages,
   PPO-clip, token aggregation: `LossConfig` defaults; the trainer's temperature equals the
   rollout's) and sends the new weights to the engine (`Engine.update_params`, a new version).
   A fresh trainer (new AdamW state and schedule) starts from the SFT weights.
5. **Held-out success after**, on the same tasks with the same sampling seeds (common random
   numbers: the difference is the policy's, not the dice's).

Prints the table and writes a PNG of the reward curve (train reward per iteration, held-out before /
after, and the SFT NLL). JSON rows (one per seed): task, steps (GRPO iterations),
heldout_reward_before, heldout_reward_after, plus seed, sft_steps, greedy before / after, the
curves and wall times. `tests/test_learning_smoke.py` runs `run()` with a tiny model and a few steps.
"""

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import Decoder, init_decoder  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.rl.evaluate import heldout_reward, sample_groups  # noqa: E402
from tiderl_jax.rl.losses import LossConfig  # noqa: E402
from tiderl_jax.rl.sft import train_tasks, warm_start  # noqa: E402
from tiderl_jax.rl.trainer import Trainer  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402

TASK = "calculator"
MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=512, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=2048)
log = logging.getLogger("learning")


@dataclasses.dataclass(frozen=True)
class Settings:
    model: ModelConfig = MODEL
    seed: int = 0  # model init, SFT / GRPO task streams and rollout sampling
    sft_steps: int = 500  # at most (and the length of the SFT learning-rate schedule)
    sft_batch: int = 32  # demonstrations per SFT step
    sft_lr: float = 3e-3
    # The warm start stops once success at the rollout temperature on `probe_tasks` train tasks x
    # `probe_samples` (outside the SFT and GRPO streams) reaches `sft_target`, checked every
    # `probe_every` steps from `sft_min_steps` on.
    sft_target: float = 0.1
    sft_min_steps: int = 200
    probe_every: int = 10
    probe_tasks: int = 32
    probe_samples: int = 4
    iterations: int = 60  # GRPO steps (~7.5 s each on an idle 2-core machine)
    tasks_per_iteration: int = 8
    group_size: int = 8
    rl_lr: float = 3e-4
    loss: LossConfig = LossConfig()
    temperature: float = 1.0  # rollout temperature = the trainer's
    heldout_tasks: int = 128
    heldout_samples: int = 4  # sampled rollouts per held-out task
    max_turns: int = 3  # the demonstration takes 2: one call, one answer
    max_new_tokens: int = 96  # per turn; the longest calculator call is ~75 tokens
    max_context: int = 576  # rollout context limit (checked before each turn)
    # A trajectory can pass max_context by its last observation (tool output or an error message):
    # the RL row leaves room for one; the trainer leaves out (and logs) anything longer. Three
    # typical trajectories (~300 tokens) share a row.
    row_len: int = 960
    sft_row_len: int = 576  # two calculator demonstrations (<= 286 tokens each) per row
    micro_rows: int = 16


QUICK = dataclasses.replace(Settings(), iterations=15, heldout_tasks=64, heldout_samples=2)


def _publish(engine: Engine, trainer: Trainer) -> None:
    """The trainer's weights to the engine (which copies them), under a new version: prefix-cache
    blocks are keyed by version, and reusing one would serve KV computed by older weights."""
    engine.update_params(trainer.params, version=engine.version + 1)


def _engine(s: Settings, model: Decoder) -> Engine:
    rows = max(s.tasks_per_iteration * s.group_size, s.heldout_tasks * s.heldout_samples,
               s.probe_tasks * s.probe_samples)
    max_running = min(64, rows)
    pages_per_seq = -(-s.max_context // 16)
    return Engine(model, EngineConfig(page_size=16, num_pages=max_running * pages_per_seq * 2 + 1,
                                      max_seq_len=pages_per_seq * 16, max_running=max_running,
                                      max_prefill_rows=16, prefill_chunk=256, decode_steps=16))


def _rollout(s: Settings, temperature: float) -> RolloutConfig:
    return RolloutConfig(max_turns=s.max_turns, max_new_tokens=s.max_new_tokens, max_context=s.max_context,
                         temperature=temperature, seed=s.seed)


def _heldout(s: Settings, engine: Engine, tok: Tokenizer) -> dict:
    sampled = heldout_reward(engine, tok, TASK, s.heldout_tasks, _rollout(s, s.temperature),
                             samples=s.heldout_samples)
    greedy = heldout_reward(engine, tok, TASK, s.heldout_tasks, _rollout(s, 0.0))
    return {"sampled": sampled, "greedy": greedy}


def supervised(s: Settings, engine: Engine, tok: Tokenizer) -> tuple[Decoder, dict]:
    """The warm start, stopped at the target (module docstring, step 2): the model and a record."""
    t0 = time.perf_counter()
    trainer = Trainer(init_decoder(s.model, seed=s.seed), TrainerConfig(
        learning_rate=s.sft_lr, lr_schedule="cosine", warmup_steps=min(20, s.sft_steps - 1), total_steps=s.sft_steps,
        row_len=s.sft_row_len, micro_rows=s.micro_rows))
    probe_tasks = train_tasks([TASK], 0, s.probe_tasks, s.seed + 1)  # another train stream
    curve, probes = [], []
    while len(curve) < s.sft_steps:
        n = min(s.probe_every, s.sft_steps - len(curve))
        curve += warm_start(trainer, tok, [TASK], n, s.sft_batch, seed=s.seed, log_every=n,
                            first_task=len(curve) * s.sft_batch)
        if len(curve) < s.sft_min_steps:
            continue
        _publish(engine, trainer)
        probe = sample_groups(engine, tok, probe_tasks, s.probe_samples, _rollout(s, s.temperature))
        success = statistics.fmean(t.reward for t in probe)
        probes.append((len(curve), success))
        log.info("sft step %d: success on %d train tasks x %d samples %.3f (target %.2f)", len(curve),
                 s.probe_tasks, s.probe_samples, success, s.sft_target)
        if success >= s.sft_target:
            break
    return trainer.model(), dict(sft_steps=len(curve), sft_nll_curve=curve, sft_probes=probes,
                                 sft_final_nll=statistics.fmean(curve[-10:]), sft_wall_s=time.perf_counter() - t0)


def reinforce(s: Settings, model: Decoder, engine: Engine, tok: Tokenizer) -> dict:
    """Held-out before, GRPO from `model`, held-out after (module docstring, steps 3-5)."""
    trainer = Trainer(model, TrainerConfig(
        loss=s.loss, learning_rate=s.rl_lr, lr_schedule="cosine", warmup_steps=min(5, s.iterations - 1),
        total_steps=s.iterations,
        row_len=s.row_len, micro_rows=s.micro_rows, temperature=s.temperature))
    start_params = jax.tree.map(jnp.copy, trainer.params)  # the train step donates trainer.params
    _publish(engine, trainer)
    before = _heldout(s, engine, tok)
    log.info("held-out %s before GRPO: sampled %.3f, greedy %.3f", TASK, before["sampled"], before["greedy"])

    t0 = time.perf_counter()
    history = []
    first_task = s.sft_steps * s.sft_batch  # after the SFT's part of the train stream: none seen twice
    for it in range(s.iterations):
        t_it = time.perf_counter()
        group_tasks = train_tasks([TASK], first_task + it * s.tasks_per_iteration, s.tasks_per_iteration, s.seed)
        trajectories = sample_groups(engine, tok, group_tasks, s.group_size, _rollout(s, s.temperature))
        rollout_s = time.perf_counter() - t_it
        metrics = trainer.rl_step(trajectories)
        _publish(engine, trainer)
        rewards = [t.reward for t in trajectories]
        mixed = sum(0 < statistics.fmean(rewards[g * s.group_size:(g + 1) * s.group_size]) < 1
                    for g in range(s.tasks_per_iteration))
        history.append(dict(iteration=it + 1, version=engine.version, reward=statistics.fmean(rewards),
                            mixed_groups=mixed, rollout_s=rollout_s, step_s=time.perf_counter() - t_it - rollout_s,
                            **{k: metrics.get(k, float("nan")) for k in
                               ("loss", "policy_loss", "entropy", "clip_fraction", "grad_norm", "tokens",
                                "dropped", "skipped")}))
        h = history[-1]
        log.info("grpo %d/%d: reward %.3f (%d/%d groups mixed), loss %.4f, entropy %.3f, clip %.3f, "
                 "grad norm %.3f, %d tokens, rollout %.1fs + step %.1fs", it + 1, s.iterations, h["reward"],
                 mixed, s.tasks_per_iteration, h["loss"], h["entropy"], h["clip_fraction"], h["grad_norm"],
                 h["tokens"], h["rollout_s"], h["step_s"])
    grpo_s = time.perf_counter() - t0
    param_delta = float(optax.tree.norm(jax.tree.map(jnp.subtract, trainer.params, start_params)))

    after = _heldout(s, engine, tok)
    log.info("held-out %s after GRPO: sampled %.3f, greedy %.3f", TASK, after["sampled"], after["greedy"])
    return dict(task=TASK, steps=s.iterations, heldout_reward_before=before["sampled"],
                heldout_reward_after=after["sampled"], heldout_greedy_before=before["greedy"],
                heldout_greedy_after=after["greedy"], seed=s.seed, heldout_tasks=s.heldout_tasks,
                heldout_samples=s.heldout_samples, tasks_per_iteration=s.tasks_per_iteration,
                group_size=s.group_size, rl_lr=s.rl_lr, grpo_param_delta=param_delta,
                engine_version=engine.version, grpo_wall_s=grpo_s, history=history)


def run(s: Settings) -> dict:
    """One seed: the warm start, then `reinforce`; one JSON row."""
    tok = Tokenizer.builtin()
    engine = _engine(s, init_decoder(s.model, seed=s.seed))  # gets the SFT weights before it samples
    model, sft = supervised(s, engine, tok)
    return dict(reinforce(s, model, engine, tok), sft_lr=s.sft_lr, **sft)


def plot(rows: list[dict], path: str) -> None:
    """Train reward per GRPO iteration and held-out before / after per seed; the SFT NLL beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_sft) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for r in rows:
        its = [h["iteration"] for h in r["history"]]
        line, = ax.plot(its, [h["reward"] for h in r["history"]], alpha=0.8,
                        label=f"seed {r['seed']}: train reward (group mean)")
        ax.plot([0, r["steps"]], [r["heldout_reward_before"], r["heldout_reward_after"]], "o--",
                color=line.get_color(), label=f"seed {r['seed']}: held-out success before / after")
        ax_sft.semilogy(range(1, len(r["sft_nll_curve"]) + 1), r["sft_nll_curve"], color=line.get_color(),
                        label=f"seed {r['seed']}")
    ax.set(xlabel="GRPO iteration", ylabel="reward (success rate)", ylim=(0, 1),
           title=f"GRPO on {TASK} from the SFT warm start")
    ax.legend(fontsize=8)
    ax_sft.set(xlabel="SFT step", ylabel="NLL of the model tokens", title="warm start")
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="15 GRPO iterations, 64 held-out tasks x 2")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--json")
    p.add_argument("--plot", default=str(ROOT / "runs" / "learning.png"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    for name in ("learning", "tiderl_jax"):
        logging.getLogger(name).setLevel(logging.INFO)
    base = QUICK if args.quick else Settings()
    rows = [run(dataclasses.replace(base, seed=seed)) for seed in args.seeds]
    print(f"\n{'task':<11}{'seed':>5}{'sft steps':>10}{'grpo steps':>11}{'before':>8}{'after':>8}"
          f"{'greedy before':>15}{'greedy after':>14}{'sft s':>7}{'grpo s':>8}")
    for r in rows:
        print(f"{r['task']:<11}{r['seed']:>5}{r['sft_steps']:>10}{r['steps']:>11}"
              f"{r['heldout_reward_before']:>8.3f}{r['heldout_reward_after']:>8.3f}"
              f"{r['heldout_greedy_before']:>15.3f}{r['heldout_greedy_after']:>14.3f}"
              f"{r['sft_wall_s']:>7.0f}{r['grpo_wall_s']:>8.0f}")
    print(f"held-out: {base.heldout_tasks} tasks x {base.heldout_samples} samples at temperature "
          f"{base.temperature} (greedy: 1 each); GRPO: {base.tasks_per_iteration} tasks x {base.group_size} "
          f"samples per iteration, lr {base.rl_lr}")
    plot(rows, args.plot)
    print(f"reward curve: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
