"""Accelerator presets from published specs: what the simulator's cost models run on.

One `Accelerator` per chip type, all numbers per chip, in SI units (FLOP/s, bytes/s, bytes). The
cost models (`costs.py`) read only these fields, so a new chip is one more preset.

Conventions (ours; vendors quote different things):
- `peak_bf16_flops` is the **dense** bf16 matrix peak. NVIDIA's datasheets headline the 2:4-sparse
  number; dense is half of it.
- `interconnect_bandwidth` is the per-chip bandwidth **in one direction** over the fast fabric
  (NVLink inside an 8-GPU node; ICI inside a TPU pod). Vendors quote the bidirectional total
  (NVLink 900 GB/s, ICI "bidirectional ... per chip"); one direction is half of it.
- `interconnect_domain` is how many chips that fabric joins (8 for an HGX/DGX node; the pod for a
  TPU); beyond it a transfer uses `inter_node_bandwidth`, per chip and one direction (InfiniBand
  NICs for GPUs, the data-center network for TPUs).
- HBM size as the vendor states it: GB (1e9) for NVIDIA, GiB (2**30) where Google's table says GiB.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2.0 ** 30
TERA = 1e12


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    hbm_bytes: float  # bytes per chip
    interconnect_bandwidth: float  # bytes/s per chip, one direction, inside the fast domain
    interconnect_domain: int  # chips the fast fabric joins
    inter_node_bandwidth: float  # bytes/s per chip, one direction, between domains
    source: str  # where the numbers come from

    def __post_init__(self):
        for name in ("peak_bf16_flops", "hbm_bandwidth", "hbm_bytes", "interconnect_bandwidth",
                     "interconnect_domain", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Accelerator {self.name!r}: {name}={getattr(self, name)} must be > 0")

    def link_bandwidth(self, chips: int) -> float:
        """Per-chip one-direction bandwidth of a transfer spanning `chips` chips: the fast fabric
        when they fit in one domain, the inter-node network otherwise."""
        if chips < 1:
            raise ValueError(f"link_bandwidth: chips={chips} must be >= 1")
        return self.interconnect_bandwidth if chips <= self.interconnect_domain else self.inter_node_bandwidth


# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity
# (989.4 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s. Inter-node: NVIDIA DGX H100 datasheet,
# 8x ConnectX-7 400 Gb/s, one NIC per GPU = 50 GB/s per GPU per direction.
H100 = Accelerator(
    name="h100", peak_bf16_flops=989.4 * TERA, hbm_bandwidth=3.35e12, hbm_bytes=80 * GB,
    interconnect_bandwidth=900 * GB / 2, interconnect_domain=8, inter_node_bandwidth=400e9 / 8,
    source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM); NVIDIA DGX H100 datasheet (networking)")

# NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity
# (989.4 dense, same Hopper compute as H100), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
# Inter-node: NVIDIA DGX H200 datasheet, 8x ConnectX-7 400 Gb/s, one per GPU.
H200 = Accelerator(
    name="h200", peak_bf16_flops=989.4 * TERA, hbm_bandwidth=4.8e12, hbm_bytes=141 * GB,
    interconnect_bandwidth=900 * GB / 2, interconnect_domain=8, inter_node_bandwidth=400e9 / 8,
    source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM); NVIDIA DGX H200 datasheet (networking)")

# Google Cloud TPU documentation, "TPU v5e" system architecture table: 197 TFLOPs bf16 per chip,
# 16 GB HBM2 at 819 GBps, ICI 1600 Gbps per chip (the newer table: 400 GBps bidirectional), pod of
# 256 chips, 2 x 100 Gbps NICs per host of 8 chips = 25 Gbps per chip over the data-center network.
TPU_V5E = Accelerator(
    name="tpu-v5e", peak_bf16_flops=197 * TERA, hbm_bandwidth=819 * GB, hbm_bytes=16 * GIB,
    interconnect_bandwidth=400 * GB / 2, interconnect_domain=256, inter_node_bandwidth=2 * 100e9 / 8 / 8,
    source="Google Cloud TPU documentation, TPU v5e system architecture")

# Google Cloud TPU documentation, "TPU v5p" system architecture table: 459 TFLOPs bf16 per chip,
# 95 GiB HBM2e at 2765 GBps, bidirectional ICI 1200 GBps per chip (older table: 4800 Gbps), pod of
# 8960 chips, data-center network 50 Gbps per chip.
TPU_V5P = Accelerator(
    name="tpu-v5p", peak_bf16_flops=459 * TERA, hbm_bandwidth=2765 * GB, hbm_bytes=95 * GIB,
    interconnect_bandwidth=1200 * GB / 2, interconnect_domain=8960, inter_node_bandwidth=50e9 / 8,
    source="Google Cloud TPU documentation, TPU v5p system architecture")

PRESETS = {a.name: a for a in (H100, H200, TPU_V5E, TPU_V5P)}
ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e",
           "v5p": "tpu-v5p", "tpu_v5e": "tpu-v5e", "tpu_v5p": "tpu-v5p"}


def accelerator(name: str) -> Accelerator:
    """The preset called `name` (case-insensitive; e.g. 'h100', 'H200', 'tpu-v5e', 'v5p')."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown accelerator {name!r}: choose one of {sorted(PRESETS)} "
                         f"(aliases {sorted(ALIASES)}) or build an Accelerator yourself")
    return PRESETS[key]
