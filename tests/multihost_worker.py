"""One process of the multi-process tests (tests/test_multihost.py), started by launch/local_cluster.py.

    python tests/multihost_worker.py exchange|decisions|die [--coordinator_address ...]

- `exchange`: the control messages (allgather, broadcast, a large object in chunks), each process sending
  its own value; prints what it got as JSON.
- `late`: process 1 reaches an exchange 2 s late; process 0 awaits it (`allgather_async`) while another task of
  its event loop ticks; prints the ticks seen during the wait.
- `decisions`: the real controller on the simulated backend, one share per process, ERS on; process 1's own
  ERS rule is replaced by one that never moves, so every move it makes is process 0's decision; prints the moves.
- `bidirl`: the real controller on the JAX backend (a tiny model, one replica per device), BiDiRL with every borrow
  process 0 considers made and none that process 1 would; prints the borrows and where the trainer ended.
- `die`: process 1 exits with status 3 after the first exchange; the others wait at the next one (their
  watchdog ends them, naming it).
"""

import json
import os
import sys
import time

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import distributed  # noqa: E402

distributed.define_flags()


def exchange(cluster) -> dict:
    gathered = cluster.allgather("numbers", {"index": cluster.index, "square": cluster.index ** 2})
    decided = cluster.broadcast("decision", f"process {cluster.index}'s choice")
    big = cluster.allgather("big", bytes([cluster.index]) * (5 << 20))  # > one chunk of the key-value store
    return dict(gathered=gathered, decided=decided, big=[(len(b), b[0]) for b in big],
                shards=distributed.merge_shards(cluster.allgather(
                    "shards", [f"item{i}" for i in distributed.shard_indices(7, cluster.index, cluster.count)])))


def late(cluster) -> dict:
    import asyncio

    cluster.barrier("started")
    if cluster.index == 1:
        time.sleep(2.0)
        return dict(gathered=cluster.allgather("late", cluster.index))

    from ticks import ticking  # tests/, this script's directory

    async def waiting():
        async with ticking(0.05) as ticks:
            t0 = time.perf_counter()
            gathered = await cluster.allgather_async("late", cluster.index)
            return dict(gathered=gathered, waited_s=time.perf_counter() - t0, ticks=ticks[0])
    return asyncio.run(waiting())


def decisions(cluster, logdir: str) -> dict:
    import asyncio

    from tiderl_jax.policies import ers
    from tiderl_jax.runtime.controller import Controller, ControllerConfig
    from tiderl_jax.runtime.multihost import local_config
    from tiderl_jax.sim.backend import SimBackend, SimConfig

    if cluster.index != 0:  # this process's own rule would never move: what moves here is process 0's decision
        def never(signals, history, config, economics=None):
            return None, ers.ERSHistory()
        ers.decide = never
    cfg = ControllerConfig(mode="tiderl", steps=6, groups_per_step=4, group_size=4, max_concurrent=32,
                           device_group_size=2, tensor=1, rollout_groups=2, ref_groups=2, train_groups=4,
                           ers_economics=False, ers_patience=1, ers_cooldown=0)
    local = local_config(cfg, cluster.count)
    backend = SimBackend.for_controller(SimConfig(seed=cluster.index), local, 16 // cluster.count)
    controller = Controller(config=cfg, logdir=logdir, backend=backend, checkpoints=False)
    backend.attach(controller.metrics)
    asyncio.set_event_loop(backend.loop)
    summary = backend.loop.run_until_complete(controller.run())
    return dict(moves=[(m["step"], m["frm"], m["to"]) for m in controller.moves], steps=summary["steps"],
                consumed=controller.consumed, ledger=summary["ledger"])


def borrows(cluster, logdir: str) -> dict:
    import asyncio

    import jax

    from tiderl_jax.agents.env import StepResult
    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.engine.engine import EngineConfig
    from tiderl_jax.model.config import ModelConfig
    from tiderl_jax.model.decoder import init_decoder
    from tiderl_jax.model.tokenizer import Tokenizer
    from tiderl_jax.policies import bidirl
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller import Controller, ControllerConfig

    def forced(s):  # process 0 makes every borrow it considers
        devices = (s.idle_devices // s.borrower_unit) * s.borrower_unit
        lender = bidirl.TRAIN if s.borrower == bidirl.ROLLOUT else bidirl.ROLLOUT
        return bidirl.BorrowDecision(devices > 0, s.borrower, lender, devices, 1.0, 0.0, "forced")

    def never(s):  # process 1's own rule would make none: what it lends is process 0's decision
        return bidirl.BorrowDecision(False, s.borrower, "", 0, 0.0, 0.0, "never")
    bidirl.decide_borrow = forced if cluster.primary else never

    class OneTurn:  # one turn, its reward varying with the reply's length (GRPO has a signal)
        async def reset(self, task):
            return task.prompt

        async def step(self, action):
            return StepResult(None, float(len(action) % 2), True)

    cfg = ControllerConfig(mode="async", bidirl=True, rollout_replicas="group", steps=2, groups_per_step=2,
                           group_size=2, max_concurrent=4, device_group_size=1, rollout_groups=6, ref_groups=0,
                           train_groups=2, tensor=1)
    model = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")
    c = Controller(init_decoder(model, seed=0), Tokenizer.builtin(), config=cfg,
                   engine_config=EngineConfig(page_size=16, num_pages=128, max_seq_len=1024, max_running=8,
                                              prefill_chunk=256, decode_steps=4),
                   rollout_config=RolloutConfig(max_turns=1, max_new_tokens=8, max_context=1024),
                   trainer_config=TrainerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, row_len=1024,
                                                micro_rows=4),
                   logdir=logdir, make_env=lambda t: OneTurn(), checkpoints=False)
    c._arrival_rate = lambda since=-float("inf"): 1.0  # the rollout borrows whenever the trainer waits
    summary = asyncio.run(c.run())
    on = {d.id for x in jax.tree.leaves(c.trainer.params) for d in x.sharding.device_set}
    return dict(borrows=[(b["step"], b["borrower"], b["devices"]) for b in c.borrows], steps=summary["steps"],
                trainer_devices=sorted(on), train_devices=sorted(d.id for d in c.pool.mesh("train").devices.flat),
                versions=[e.version for e in c.backend.engines], version=c.version,
                loss=[float(x) for x in c.metrics.rewards])


def main(argv):
    mode = argv[1]
    cluster = distributed.initialize_from_flags()
    cluster.start_watchdog()
    if mode == "exchange":
        out = exchange(cluster)
    elif mode == "late":
        out = late(cluster)
    elif mode == "decisions":
        out = decisions(cluster, os.path.join(argv[2], f"p{cluster.index}"))
    elif mode == "bidirl":
        out = borrows(cluster, os.path.join(argv[2], f"p{cluster.index}"))
    elif mode == "die":
        cluster.barrier("started")
        if cluster.index == 1:
            os._exit(3)
        cluster.barrier("after the death")
        out = {}
        time.sleep(600)
    print("RESULT " + json.dumps(out), flush=True)
    cluster.finished()


if __name__ == "__main__":
    app.run(main)
