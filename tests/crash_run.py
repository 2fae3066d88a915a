"""A small controller run for the crash-resume test: resumes from LOGDIR's checkpoint if there is
one, checkpoints after every step, prints a line per step. `python tests/crash_run.py LOGDIR STEPS`."""

import asyncio
import json
import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402
from tiderl_jax.runtime.controller import Controller, ControllerConfig  # noqa: E402

CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")


def main(logdir: str, steps: int):
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    logging.getLogger("tiderl_jax.runtime.metrics").setLevel(logging.INFO)  # "step k/n" lines
    c = Controller(init_decoder(CFG, seed=0), Tokenizer.builtin(),
                   config=ControllerConfig(mode="async", steps=steps, groups_per_step=2, group_size=2,
                                           max_concurrent=8, checkpoint_every=1, task_kinds=("calculator",)),
                   engine_config=EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=16,
                                              prefill_chunk=256, decode_steps=4),
                   rollout_config=RolloutConfig(max_turns=2, max_new_tokens=16, max_context=1024),
                   trainer_config=TrainerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=steps + 1,
                                                row_len=1024, micro_rows=4),
                   latency=LatencyModel(0.05, 0.5), logdir=logdir)
    resumed = c.restore()
    print(json.dumps({"resumed_at": c.step if resumed else None}), flush=True)
    summary = asyncio.run(c.run())
    print(json.dumps({"done": summary["steps"], "ledger": summary["ledger"], "consumed": c.consumed,
                      "running": c.unfinished()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
