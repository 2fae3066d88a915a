"""Simulator hardware presets and roofline cost models on hand-worked numbers (issue 8)."""

import types

import pytest

from tiderl_jax.sim import costs, hardware
from tiderl_jax.sim.costs import Efficiency, ModelShape
from tiderl_jax.sim.hardware import Accelerator

# A toy chip and model small enough to work every number by hand.
CHIP = Accelerator("toy", peak_bf16_flops=1000.0, hbm_bandwidth=100.0, hbm_bytes=10_000.0,
                   interconnect_bandwidth=50.0, interconnect_domain=4, inter_node_bandwidth=10.0, source="test")
# layer: q 4x4 + k,v 2 * 4x2 + o 4x4 = 48, MLP 3 * 4 * 8 = 96, norms 2 * 4 = 8 -> 152
# params: embed 10 * 4 = 40, layers 2 * 152 = 304, final norm 4, LM head 40 -> 388; matmul 348
TOY = ModelShape("toy", num_layers=2, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1,
                 head_dim=2, vocab_size=10, dtype_bytes=2)
PEAK = Efficiency(prefill_mfu=1.0, decode_mfu=1.0, mbu=1.0, train_mfu=1.0, score_mfu=1.0)


def test_presets_carry_the_vendor_numbers():
    h100, h200 = hardware.accelerator("H100"), hardware.accelerator("h200-sxm")
    assert h100.peak_bf16_flops == pytest.approx(989.4e12)  # half the 1,979 TFLOPS sparse headline
    assert (h100.hbm_bandwidth, h100.hbm_bytes) == (3.35e12, 80e9)
    assert (h200.hbm_bandwidth, h200.hbm_bytes) == (4.8e12, 141e9)
    assert h100.peak_bf16_flops == h200.peak_bf16_flops
    assert h100.interconnect_bandwidth == 450e9  # NVLink 900 GB/s bidirectional
    assert h100.inter_node_bandwidth == 50e9  # one 400 Gb/s ConnectX-7 per GPU
    v5e, v5p = hardware.accelerator("v5e"), hardware.accelerator("TPU-v5p")
    assert (v5e.peak_bf16_flops, v5e.hbm_bandwidth, v5e.hbm_bytes) == (197e12, 819e9, 16 * 2**30)
    assert (v5p.peak_bf16_flops, v5p.hbm_bandwidth, v5p.hbm_bytes) == (459e12, 2765e9, 95 * 2**30)
    assert v5e.interconnect_bandwidth == 200e9 and v5p.interconnect_bandwidth == 600e9
    assert (v5e.interconnect_domain, v5p.interconnect_domain) == (256, 8960)
    for a in hardware.PRESETS.values():
        assert a.source


def test_unknown_accelerator_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown accelerator 'a100'.*h100"):
        hardware.accelerator("a100")
    with pytest.raises(ValueError, match="hbm_bandwidth=0"):
        Accelerator("bad", 1.0, 0.0, 1.0, 1.0, 1, 1.0, "test")


def test_link_bandwidth_leaves_the_fast_domain_beyond_its_size():
    assert CHIP.link_bandwidth(1) == CHIP.link_bandwidth(4) == 50.0
    assert CHIP.link_bandwidth(5) == 10.0
    with pytest.raises(ValueError, match="chips=0"):
        CHIP.link_bandwidth(0)


def test_parameter_counts_match_the_published_sizes():
    assert TOY.params == 388 and TOY.matmul_params == 348 and TOY.param_bytes == 776
    assert costs.QWEN2_5_7B.params == 7_615_616_512  # "7.61B" on the model card
    assert costs.QWEN2_5_14B.params == 14_770_033_664  # "14.7B"
    assert costs.model_shape("Qwen2.5-7B") is costs.QWEN2_5_7B
    with pytest.raises(ValueError, match="unknown model shape 'llama-70b'"):
        costs.model_shape("llama-70b")


def test_kv_bytes_per_token():
    assert costs.kv_bytes_per_token(TOY) == 2 * 2 * 1 * 2 * 2  # K and V, layers, kv heads, head_dim, bf16
    assert costs.kv_bytes_per_token(costs.QWEN2_5_7B) == 57_344  # 56 KiB
    assert costs.kv_bytes_per_token(costs.QWEN2_5_14B) == 196_608  # 192 KiB


def test_shape_from_a_config_like_object():
    # ModelConfig's defaults: 4 layers, hidden 256, MLP 768, 4 heads, 2 KV heads, head_dim 64, vocab 512,
    # tied, float32: layer 65536 + 2 * 32768 + 65536 + 3 * 256 * 768 + 512 = 786944
    from tiderl_jax.model.config import ModelConfig  # plain dataclass, no JAX
    shape = costs.shape_from_config(ModelConfig(), name="tiny")
    assert shape.dtype_bytes == 4 and shape.tie_word_embeddings
    assert shape.params == 512 * 256 + 4 * 786_944 + 256
    assert shape.matmul_params == shape.params  # tied: the embedding is the LM head's matmul
    qwen3 = costs.shape_from_config(ModelConfig(qk_norm=True), dtype="bfloat16")
    assert qwen3.params == shape.params + 4 * 2 * 64 and qwen3.dtype_bytes == 2
    with pytest.raises(ValueError, match=r"lacks \['head_dim'"):
        costs.shape_from_config(types.SimpleNamespace(num_layers=1, hidden_size=1, intermediate_size=1,
                                                      num_heads=1, num_kv_heads=1, vocab_size=1))
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        ModelShape("bad", 1, 4, 4, 3, 2, 2, 10)


def test_prefill_is_memory_bound_short_and_compute_bound_with_context():
    # 10 new tokens, no context: pairs 55; flops 2*348*10 + 4*2*2*2*55 = 8720 (8.72 s);
    # bytes 776 + 16*10 = 936 (9.36 s) -> memory bound
    assert costs.causal_pairs(10, 0) == 55
    assert costs.prefill_time(TOY, CHIP, 10, eff=PEAK) == pytest.approx(9.36)
    # after 5 cached tokens: pairs 105, flops 6960 + 3360 = 10320 (10.32 s); bytes 776 + 16*15 (10.16 s)
    assert costs.prefill_time(TOY, CHIP, 10, 5, eff=PEAK) == pytest.approx(10.32)
    assert costs.prefill_time(TOY, CHIP, 10, 5, devices=2, eff=PEAK) == pytest.approx(5.16)
    half_mfu = Efficiency(prefill_mfu=0.5, mbu=1.0)
    assert costs.prefill_time(TOY, CHIP, 10, 5, eff=half_mfu) == pytest.approx(20.64)
    assert costs.prefill_time(TOY, CHIP, 0, 100) == 0.0


def test_decode_step_reads_weights_and_all_kv():
    # batch 4 holding 20 tokens: flops 2*348*4 + 32*20 = 3424 (3.424 s); bytes 776 + 16*24 = 1160 (11.6 s)
    assert costs.decode_step_time(TOY, CHIP, 4, 20, eff=PEAK) == pytest.approx(11.6)
    assert costs.decode_step_time(TOY, CHIP, 4, 20, devices=2, eff=PEAK) == pytest.approx(5.8)
    assert costs.decode_step_time(TOY, CHIP, 0, 0) == 0.0
    # 7B on one H100, batch 1, 1000 tokens of context: (15,231,233,024 + 57,344 * 1001) B / (3.35e12 * 0.8)
    t = costs.decode_step_time(costs.QWEN2_5_7B, hardware.H100, 1, 1000)
    assert t == pytest.approx((15_231_233_024 + 57_344 * 1001) / (3.35e12 * 0.8))
    with pytest.raises(ValueError, match="batch=-1"):
        costs.decode_step_time(TOY, CHIP, -1, 0)


def test_kv_capacity_in_pages():
    # (10000 - 776) / (4 * 16) = 144.1 -> 144 pages
    assert costs.kv_capacity_pages(TOY, CHIP, 4, memory_fraction=1.0) == 144
    assert costs.kv_capacity_pages(TOY, CHIP, 4, memory_fraction=1.0, reserve_bytes=1000) == 128
    assert costs.kv_capacity_pages(TOY, CHIP, 4, memory_fraction=0.5, devices=2) == 144
    assert costs.kv_capacity_pages(TOY, CHIP, 4, memory_fraction=0.5) == 66  # (5000 - 776) / 64
    small = Accelerator("small", 1.0, 1.0, 500.0, 1.0, 1, 1.0, "test")
    with pytest.raises(ValueError, match="does not fit 1 x small"):
        costs.kv_capacity_pages(TOY, small, 4)
    with pytest.raises(ValueError, match="page_size=0"):
        costs.kv_capacity_pages(TOY, CHIP, 0)


def test_train_and_score_time():
    # 6 * 348 * 100 = 208800 FLOPs on 2 chips of 1000 FLOP/s
    assert costs.train_step_time(TOY, CHIP, 100, devices=2, eff=PEAK) == pytest.approx(104.4)
    # sequences of 9: pairs 100 * 10 / 2 = 500, attention forward 32 * 500 = 16000, x3 with backward
    assert costs.train_step_time(TOY, CHIP, 100, devices=2, seq_len=9, eff=PEAK) == pytest.approx(128.4)
    assert costs.score_time(TOY, CHIP, 100, devices=2, seq_len=9, eff=PEAK) == pytest.approx(42.8)
    assert costs.train_step_time(TOY, CHIP, 100, devices=2, eff=Efficiency(train_mfu=0.4)) == pytest.approx(261.0)
    with pytest.raises(ValueError, match="devices=0"):
        costs.train_step_time(TOY, CHIP, 100, devices=0)
    with pytest.raises(ValueError, match=r"Efficiency.train_mfu=1.5 must be in \(0, 1\]"):
        Efficiency(train_mfu=1.5)


def test_weight_sync_and_switch_cost():
    # 776 bytes onto a 2-chip replica inside the domain: 776 / (50 * 2) + 1 s latency
    assert costs.weight_sync_time(TOY, CHIP, receiver_devices=2, span_devices=4, latency_s=1.0) == pytest.approx(8.76)
    # spanning 8 chips leaves the 4-chip domain: 10 B/s per chip
    assert costs.weight_sync_time(TOY, CHIP, receiver_devices=2, span_devices=8, latency_s=1.0) == pytest.approx(39.8)
    assert costs.switch_time(1000.0, CHIP, devices=4, span_devices=2, fixed_s=3.0) == pytest.approx(8.0)
    # 7B over NVLink to a TP-2 replica: 15.23 GB / (450 GB/s * 2)
    t = costs.weight_sync_time(costs.QWEN2_5_7B, hardware.H100, receiver_devices=2, span_devices=8)
    assert t == pytest.approx(15_231_233_024 / 900e9)
    with pytest.raises(ValueError, match="latency_s=-1"):
        costs.transfer_time(1.0, 1.0, latency_s=-1)
