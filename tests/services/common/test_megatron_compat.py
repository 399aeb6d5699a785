"""Every ModelLink flag `meshline evaluate` / `generate` take is applied, checked or refused:
each `check` row passes on the checkpoint it describes and fails, naming both values, on one it
does not; no row is accepted without effect."""

from __future__ import annotations

import argparse

import pytest

from models.config import ModelConfig
from services.common import megatron_compat
from services.common.megatron_compat import TABLE, Resolved, check_model

LLAMA = ModelConfig(
    vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
    ffn_hidden_size=128, max_position_embeddings=32, norm_type="rmsnorm", norm_eps=1e-6,
    position_embedding="rope", rope_theta=10000.0, activation="swiglu", tie_word_embeddings=False,
)  # fmt: skip
GPT = ModelConfig(
    family="gpt", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
    ffn_hidden_size=256, max_position_embeddings=32, norm_type="layernorm", norm_eps=1e-5,
    position_embedding="learned", activation="gelu", attention_bias=True, mlp_bias=True,
    qkv_bias=True, tie_word_embeddings=True,
)  # fmt: skip
# A value each valued check row accepts for LLAMA, and one it refuses.
VALUES = {
    "--num-layers": ("2", "3"), "--hidden-size": ("64", "96"), "--ffn-hidden-size": ("128", "64"),
    "--num-attention-heads": ("4", "8"), "--max-position-embeddings": ("32", "64"),
    "--seq-length": ("32", "33"), "--position-embedding-type": ("rope", "alibi"),
    "--normalization": ("RMSNorm", "LayerNorm"), "--norm-epsilon": ("1e-6", "1e-5"),
    "--num-query-groups": ("2", "4"), "--kv-channels": ("16", "32"),
    "--rotary-base": ("10000", "500000"), "--vocab-size": ("500", "600"),
}  # fmt: skip
SWITCHES_TRUE_FOR_LLAMA = {
    "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--group-query-attention", "--use-rotary-position-embeddings", "--no-position-embedding",
}  # fmt: skip


def _checked(row, value, model: ModelConfig) -> str | None:
    try:
        check_model(Resolved(checks=[(row, value)]), model)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("row", [r for r in TABLE if r.kind == "check"], ids=lambda r: r.flag)
def test_each_check_row_passes_on_its_checkpoint_and_names_a_contradiction(row):
    if row.flag.startswith("--lora"):
        args = argparse.Namespace(**{row.dest: ["8"] if row.nargs != 1 else "8"})
        with pytest.raises(ValueError, match=f"{row.flag} describes a LoRA adapter"):
            megatron_compat.resolve(args)
        args.lora_load = "adapter/"
        assert megatron_compat.resolve(args).checks == []  # the adapter carries them
        return
    if row.nargs == 0:
        assert row.flag in SWITCHES_TRUE_FOR_LLAMA or row.flag == "--add-qkv-bias"
        holds, fails = (LLAMA, GPT) if row.flag in SWITCHES_TRUE_FOR_LLAMA else (GPT, LLAMA)
        assert _checked(row, True, holds) is None
        assert row.flag in (_checked(row, True, fails) or "")
        return
    good, bad = VALUES[row.flag]
    assert _checked(row, good, LLAMA) is None
    message = _checked(row, bad, LLAMA)
    assert message is not None and f"{row.flag} {bad}" in message


def test_no_row_is_accepted_without_effect():
    for row in TABLE:
        assert row.kind in ("map", "same", "check", "refuse"), row.flag
        assert row.note, row.flag  # a same row says why Meshline already behaves so
        if row.kind in ("check", "map") and not row.sets:
            assert row.convert is not None, row.flag


def test_refused_and_one_process_rows():
    def resolve(**given):
        return megatron_compat.resolve(
            argparse.Namespace(**{f"megatron__{k}": v for k, v in given.items()})
        )

    with pytest.raises(ValueError, match="--deepspeed-config is not supported here"):
        resolve(deepspeed_config="ds.json")
    with pytest.raises(ValueError, match="serve it sharded"):
        resolve(pipeline_model_parallel_size="2")
    assert resolve(tensor_model_parallel_size="1", use_flash_attn=True).settings == {}
    with pytest.raises(ValueError, match="`meshline generate` runs one prompt"):
        resolve(micro_batch_size="4")  # no --batch-size: generate
