"""Parameter counts against the published model sizes, FLOPs per token, Korthikanti formulas."""

from __future__ import annotations

import pytest

from models.accounting import count_parameters, flops_per_token, parameter_breakdown
from models.config import ModelConfig
from models.memory import (
    TrainingLayout,
    estimate,
    in_flight_microbatches,
    korthikanti_layer_bytes,
    layer_activation_bytes,
)
from models.registry import get_config

# Totals printed by HF transformers for the released checkpoints.
PUBLISHED_COUNTS = {
    "llama-7B": 6_738_415_616,
    "llama-13B": 13_015_864_320,
    "llama-33B": 32_528_943_616,
    "llama-65B": 65_285_660_672,
    "llama2-70B": 68_976_648_192,
    "baichuan-7B": 7_000_559_616,
    "bloom-7B1": 7_069_016_064,
    "bloom-176B": 176_247_271_424,
    "llama3.1-8B": 8_030_261_248,
    "llama3.2-1B": 1_235_814_400,
    "qwen2.5-0.5B": 494_032_768,
    "qwen2.5-7B": 7_615_616_512,
    "qwen3-8B": 8_190_735_360,
    "qwen3-30B-A3B": 30_532_122_624,
    "mistral-7B": 7_241_732_096,
    "mixtral-8x7B": 46_702_792_704,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_parameter_count_matches_published(name):
    assert count_parameters(get_config(name)) == PUBLISHED_COUNTS[name]


@pytest.mark.parametrize("name", ["qwen3-0.6B", "qwen1.5-moe-A2.7B", "tiny-qwen2-moe"])
def test_parameter_count_equals_the_built_model(name):
    from models import build_model

    config = get_config(name)
    built = build_model(config, device="meta")
    assert count_parameters(config) == sum(p.numel() for p in built.parameters())


def test_flops_per_token_formula():
    config = get_config("llama2-7B")
    n = count_parameters(config) - config.vocab_size * config.hidden_size
    expected = 6 * n + 12 * 32 * 32 * 128 * 4096
    assert flops_per_token(config, 4096) == expected
    bloom = get_config("bloom-7B1")  # tied: the shared matrix is the head's matmul, so it counts
    assert flops_per_token(bloom, 2048) == 6 * count_parameters(bloom) + 12 * 30 * 4096 * 2048
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(config, 0)


def _gpt(hidden=1024, heads=16):
    """A GPT-shaped config: GeLU MLP of 4h, full MHA, dropout on — Korthikanti's setting."""
    return ModelConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        activation="gelu",
        norm_type="layernorm",
        attention_dropout=0.1,
        hidden_dropout=0.1,
    )


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (4, True)])
def test_generic_layer_bytes_reduce_to_korthikanti(t, sp):
    config = _gpt()
    s, b, h, a = 2048, 2, 1024, 16
    layout = TrainingLayout(
        tensor_parallel=t,
        sequence_parallel=sp,
        precision="bf16",
        micro_batch_size=b,
        seq_length=s,
        flash_attention=False,
    )
    ours = layer_activation_bytes(config, layout)
    paper = korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=sp)
    assert ours == pytest.approx(paper, rel=1e-12)
    if t == 1:
        assert paper == 34 * s * b * h + 5 * a * s * s * b


def test_korthikanti_recompute_variants():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    assert korthikanti_layer_bytes(
        s, b, h, a, t, sequence_parallel=True, recompute="selective"
    ) == (34 * s * b * h / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, recompute="full") == 2 * s * b * h
    layout = TrainingLayout(precision="bf16", micro_batch_size=b, seq_length=s, recompute="full")
    assert layer_activation_bytes(get_config("llama-7B"), layout) == 2 * s * b * h


def test_model_states_follow_the_trainers_precision_modes():
    """Bytes per parameter as Meshline keeps them (llama-7B: every dim divides by 8, so ZeRO's
    per-tensor chunks are exact eighths); the dry run checks the same counting rank by rank."""
    config = get_config("llama-7B")
    n = count_parameters(config)

    def states(**layout):
        row = estimate(config, TrainingLayout(**layout))[0]
        return row.parameters, row.gradients, row.optimizer, row.host

    assert states() == (4 * n, 4 * n, 8 * n, 0)  # fp32 AdamW
    # bf16 master weights: bf16 params and grads + a persistent fp32 grad, fp32 master + moments.
    assert states(precision="bf16") == (2 * n, 6 * n, 12 * n, 0)
    assert states(precision="bf16", release_fp32_grad=True) == (2 * n, 2 * n, 12 * n, 0)
    # ZeRO-1 under bf16 trains fp32 params with autocast; the moments are chunked over DP.
    assert states(precision="bf16", zero_stage=1, data_parallel=8) == (4 * n, 4 * n, n, 0)
    # ZeRO-2/3 (FSDP2): fp32 parameter, gradient and moment shards.
    for stage in (2, 3):
        assert states(precision="bf16", zero_stage=stage, data_parallel=8) == (n // 2, n // 2, n, 0)
    assert states(zero_stage=3, data_parallel=8, cpu_offload=True) == (0, 0, 0, 2 * n)
    assert states(optimizer="sgd") == (4 * n, 4 * n, 4 * n, 0)


def test_pipeline_rows_and_in_flight_microbatches():
    config = get_config("llama2-13B")
    rows = estimate(config, TrainingLayout(pipeline_parallel=4, precision="bf16", seq_length=4096))
    assert [r.kind for r in rows] == ["first stage", "middle stage", "last stage"]
    layout = TrainingLayout(pipeline_parallel=4)
    assert [in_flight_microbatches(layout, r) for r in range(4)] == [4, 3, 2, 1]
    # All four stages hold 10 layers; the first rank keeps 4 micro-batches of them in flight.
    assert rows[0].activations > rows[1].activations
    parts = parameter_breakdown(config)
    middle_params = 10 * parts.per_layer
    assert rows[1].parameters == 2 * middle_params


def test_optimizer_offload_moves_the_moments_off_the_device():
    """--optimizer-cpu-offload: AdamW's 8 bytes an element go to the host (cpu tier) or to swap
    files (nvme tier); the fp32 parameters, gradients and master copies stay on the device; the
    step's host buffers are counted where it stages (an accelerator run)."""
    config = get_config("llama-7B")
    n = count_parameters(config)
    mib64 = 4 * (1 << 22) * 4  # one buffer kind: 4 slots of 4Mi fp32 elements

    def states(**layout):
        row = estimate(config, TrainingLayout(**layout))[0]
        return row.parameters, row.gradients, row.optimizer, row.host, row.nvme

    assert states(optimizer_offload="cpu") == (4 * n, 4 * n, 0, 8 * n + 2 * mib64, 0)
    assert states(optimizer_offload="nvme") == (4 * n, 4 * n, 0, 4 * mib64, 8 * n)
    assert states(optimizer_offload="nvme", staged_offload=False) == (
        4 * n, 4 * n, 0, 2 * mib64, 8 * n
    )  # fmt: skip
    assert states(optimizer_offload="cpu", staged_offload=False)[3] == 8 * n
    # bf16 master weights: the fp32 master copy stays on the device, the moments leave.
    assert states(precision="bf16", optimizer_offload="cpu")[:3] == (2 * n, 6 * n, 4 * n)
    # ZeRO-3 with --cpu-offload and the nvme tier: the host keeps the shards (stepped in place,
    # no staging), the moments go to the files.
    assert states(zero_stage=3, data_parallel=8, cpu_offload=True, optimizer_offload="nvme") == (
        0, 0, 0, n + 2 * mib64, n
    )  # fmt: skip
    with pytest.raises(ValueError, match="--optimizer sgd has no offloaded form"):
        TrainingLayout(optimizer="sgd", optimizer_offload="cpu")


def test_parameter_nvme_tier_moves_the_shards_off_the_host():
    """--param-nvme-path on top of --cpu-offload: each rank's fp32 shards leave the host for the
    NVMe column; the host keeps the tier's 5 buffers, each the rank's shards of the largest
    gather group (for llama-7B the root's: embedding, head and final norm)."""
    config = get_config("llama-7B")
    n = count_parameters(config)
    base = {"zero_stage": 3, "data_parallel": 8, "cpu_offload": True, "optimizer_offload": "nvme"}
    kept = estimate(config, TrainingLayout(**base))[0]
    moved = estimate(config, TrainingLayout(**base, param_nvme=True))[0]
    root = 2 * config.vocab_size * config.hidden_size + config.hidden_size
    assert moved.nvme - kept.nvme == 4 * n // 8
    assert kept.host - moved.host == 4 * n // 8 - 5 * 4 * root // 8
    assert (moved.parameters, moved.gradients, moved.optimizer) == (0, 0, 0)
    with pytest.raises(ValueError, match="parameters on NVMe need --cpu-offload"):
        TrainingLayout(zero_stage=3, optimizer_offload="cpu", param_nvme=True)
