"""Cluster-scale simulator (issue 8): the same controller and policies on cost-modelled devices.

Parts: `backend` (`SimBackend`: the runtime controller's `Backend` on the parts below; `run`), and
- `hardware`: accelerator presets from vendor specs (H100, H200, TPU v5e, TPU v5p);
- `costs`: roofline cost models (prefill, decode, KV capacity, train, ref scoring, weight sync,
  device moves) and model shapes (Qwen2.5-7B / 14B);
- `clock`: a virtual-time asyncio event loop (sleeps and timeouts take no wall time);
- `workloads`: workload presets after the papers, with the sampling distributions.

The simulator never imports JAX model code (ARCHITECTURE.md): only `policies/` and the runtime's
controller interfaces.
"""
