"""Fault tolerance (Belayer, MECHANISMS.md §5): environments and rollout engines in worker processes,
their snapshots and token checkpoints, crash and hang detection, standby promotion.

The decisions (health threshold, when to checkpoint, retry or drop) are pure functions in
`tiderl_jax/policies/belayer.py`. Not yet wired into the runtime controller.
"""
