"""Fault tolerance (Belayer, docs/mechanisms.md): environments and rollout engines in worker processes,
their snapshots and token checkpoints, crash and hang detection, standby promotion.

The decisions (health threshold, when to checkpoint, retry or drop) are pure functions in
`tiderl_jax/policies/belayer.py`. The controller uses them through its options `env_workers` and
`engine_workers`.
"""
