"""Cluster simulation of the TideRL text preset: the real controller on `sim.backend.SimBackend`.

    python launch/simulate.py --config=configs/sim_tiderl_text.py [--config.sizes=32,64] [--config.steps=10]

Workload `tiderl-text-7b` (sim/workloads.py: each parameter the paper's or ours). Per cluster size the
batch scales with the devices (prompts_per_step * size / the preset's 32 devices, GRPO groups of the
preset's size). Device layouts are those of benchmarks/goodput.py, in device groups:
async half rollout, half train (reference scored on the train devices); tiderl half rollout, a quarter
reference, a quarter train (RA2P and ERS move work and groups from there); sync all devices for both.
A device group is 1/16 of the cluster (at least one 8-GPU node), so ERS's one move per step is the same
share of the cluster at every size.
`+war` adds WAR's speculative-decoding switch to the replicas (sim.backend.SimConfig.war_speculation),
`+bidirl` BiDiRL's borrowing within steps (and, for async, its static planner).
Nothing here is tuned to reach a published number.
"""

from ml_collections import ConfigDict


def get_config():
    c = ConfigDict()
    c.logdir = "runs/sim_tiderl_text"
    c.workload = "tiderl-text-7b"
    c.accelerator = ""  # "" = the workload's
    c.sizes = (32, 64, 128, 256)  # accelerators; 1024 works too (100 steps: under a minute per mode, compiled)
    c.modes = ("sync", "sync+war", "async", "tiderl", "tiderl+bidirl")
    c.steps = 20  # optimizer updates per run
    c.oracle_train_groups = ()  # async@oracle: train group counts its sweep tries (empty: every split)
    c.bidirl_probes = 5  # async+bidirl: rollout/train splits its static planner simulates
    c.bidirl_probe_steps = 4  # and steps per probe
    c.seed = 0
    c.timelines = True  # a timeline PNG per mode at the smallest size
    c.controller = ConfigDict({
        "eta": 1, "concurrency_batches": 2,  # max_concurrent = concurrency_batches * batch samples
        # device groups: size / device_groups devices each, at least one node of device_group_size (ERS
        # moves one group per step: a group stays 1/16 of the cluster as it grows)
        "device_group_size": 8, "device_groups": 16, "ers_patience": 2, "ers_cooldown": 3,
        # fractions of the device groups per role (the rest of a mode's groups go to rollout)
        "async_train": 0.5, "tiderl_ref": 0.25, "tiderl_train": 0.25})
    c.sim = ConfigDict({
        "tp": 1, "page_size": 16, "memory_fraction": 0.9, "kv_pages": 0, "max_batch": 256, "decode_chunk": 32,
        "initial_growth": 256, "readiness_aware": False, "sync_fixed_s": 0.5, "switch_fixed_s": 3.0,
        "optimizer_bytes_per_param": 8.0})
    c.efficiency = ConfigDict({"prefill_mfu": 0.5, "decode_mfu": 0.5, "mbu": 0.8, "train_mfu": 0.4,
                               "score_mfu": 0.5})
    return c
