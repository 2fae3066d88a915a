"""The engine's configuration (`EngineConfig`): page pool, limits, prefill and decode settings, shape
buckets; each checked when built. `engine.py` re-exports it."""

from __future__ import annotations

import dataclasses

from tiderl_jax.policies import war


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 4096  # including the trash page
    max_seq_len: int = 4096  # longest context (prompt + all turns) a sequence may reach
    max_running: int = 64  # sequences prefilling or decoding at once (decode batch)
    prefill_chunk: int = 512  # longest chunk of one sequence per step
    max_prefill_rows: int = 16  # sequences prefilled together in one step
    prefill_budget: int = 2048  # prompt tokens per step (the full budget)
    prefill_pressure_budget: int = 256  # P-PAS cap under prefill pressure
    prefill_policy: str = "static"  # "static" | "ppas"
    decode_steps: int = 16  # decode steps per call when no prefill is pending
    # a prefill call's tokens packed back to back in a bucket of their sum (projections and MLP compute no row or
    # chunk padding; the attention alone runs in the padded [rows, width] view); False: the padded block itself,
    # rows x width token slots (fewer programs to compile)
    ragged_prefill: bool = True
    enable_prefix_cache: bool = True
    reuse_stale_prefix_cache: bool = False
    on_update: str = "continue"  # "continue" | "abort"
    # "auto": JAX's Pallas kernel on a GPU / TPU, the C++ kernel on one CPU device (float32), else "xla"; or one
    # of "xla", "cpu", "pallas_gpu", "pallas_tpu", "reference" (engine/paged_attention.py)
    attention_impl: str = "auto"
    max_stop_ids: int = 8
    # How far apart the shape buckets are (each bucket is one compiled program per shape): 2 = powers of
    # two (decode's attention span 1.5x apart); 4 = powers of four everywhere: about a sixth of the programs
    # to compile (the main job's engine: 27 programs, a cold warm-up under a minute on 2 CPU cores), for more
    # padding per call (a short job's choice).
    bucket_growth: int = 2
    # WAR's model-free speculative decoding (engine/speculation.py): "off"; "on" (every decode step at a batch of
    # at most spec_max_batch); "auto" (policies.war.use_speculation per step, on this engine's measured step
    # times and acceptance). Its verify programs are compiled by `warmup` only when it is not "off".
    speculation: str = "off"
    spec_tokens: int = 4  # drafted tokens verified per step and sequence
    spec_max_batch: int = war.SPEC_MAX_BATCH  # WAR: speculation only at effective batches up to this
    # the drafter's memory bound: tokens indexed over all its draft keys (least recently used keys dropped past
    # it; engine/drafter.py: about 2.2 KB per token at worst, so 1M tokens is at most ~2.3 GB)
    draft_max_tokens: int = 1 << 20

    def __post_init__(self):
        if self.on_update not in ("continue", "abort"):
            raise ValueError(f"on_update={self.on_update!r} is not 'continue' or 'abort'")
        if self.prefill_policy not in ("static", "ppas"):
            raise ValueError(f"prefill_policy={self.prefill_policy!r} is not 'static' or 'ppas'")
        if self.speculation not in ("off", "on", "auto"):
            raise ValueError(f"speculation={self.speculation!r} is not 'off', 'on' or 'auto'")
        from tiderl_jax.engine.paged_attention import AUTO, PAGED_ATTENTION
        if self.attention_impl not in (AUTO, *PAGED_ATTENTION):
            raise ValueError(f"attention_impl={self.attention_impl!r} is not one of {[AUTO, *sorted(PAGED_ATTENTION)]}")
        for name in ("page_size", "num_pages", "max_seq_len", "max_running", "prefill_chunk", "max_prefill_rows",
                     "prefill_budget", "decode_steps", "spec_tokens", "spec_max_batch",
                     "draft_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.bucket_growth not in (2, 4):
            raise ValueError(f"bucket_growth={self.bucket_growth} is not 2 or 4")
        if self.max_seq_len % self.page_size:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be a multiple of page_size")
