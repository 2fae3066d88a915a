"""Cluster simulation of the BiDiRL math preset: sync, async, and async with BiDiRL (static planner +
bidirectional borrowing), on `sim.backend.SimBackend`.

    python launch/simulate.py --config=configs/sim_bidirl_math.py [--config.sizes=32,64] [--config.steps=10]

Workload `bidirl-math` (sim/workloads.py: single-turn math RL, long-tailed response lengths; each
parameter the paper's or ours). `async+bidirl` starts from the split the static planner picks on
probe-measured times (`bidirl_probes` splits, `bidirl_probe_steps` steps each) and borrows idle
devices within steps by `policies.bidirl.decide_borrow`. Everything else as configs/sim_tiderl_text.py.
"""

from configs import sim_tiderl_text


def get_config():
    c = sim_tiderl_text.get_config()
    c.logdir = "runs/sim_bidirl_math"
    c.workload = "bidirl-math"
    c.modes = ("sync", "async", "async+bidirl")
    return c
