"""Resharding Megatron checkpoints: any TP/PP (and virtual chunks) to any other, logits equal;
the QKV and SwiGLU layouts checked against a loop-by-loop construction of Megatron's order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints.megatron_format import MegatronSource
from checkpoints.megatron_format import load_file as load_megatron
from checkpoints.megatron_layout import (
    StageLayout,
    layer_from_megatron,
    layer_to_megatron,
)
from models.registry import get_config
from services.converter.job import ConvertOptions, convert
from services.converter.verify import fixed_logits, load_model
from tests.services.converter.conftest import VOCAB


def test_tp2_pp2_to_tp1_pp4_gives_equal_logits(llama_dir, tmp_path):
    src, dst = tmp_path / "tp2pp2", tmp_path / "tp1pp4"
    convert(ConvertOptions("hf", "megatron", llama_dir, src, target_tp=2, target_pp=2))
    convert(ConvertOptions("megatron", "megatron", src, dst, target_tp=1, target_pp=4))
    assert sorted(p.name for p in (dst / "release").iterdir()) == [
        f"mp_rank_00_{stage:03d}" for stage in range(4)
    ]
    before, after = load_model(MegatronSource(src, None)), load_model(MegatronSource(dst, None))
    assert torch.equal(fixed_logits(before), fixed_logits(after))
    # ... and both equal HF's own forward pass (our decoder vs transformers, fp32).
    hf = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(after(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_virtual_pipeline_chunks_round_trip(bloom_dir, tmp_path):
    vpp, back = tmp_path / "vpp", tmp_path / "back"
    convert(
        ConvertOptions(
            "hf", "megatron", bloom_dir, vpp, target_tp=2, target_pp=2, layers_per_virtual_stage=1
        )
    )
    stage1 = load_megatron(vpp / "release" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert sorted(k for k in stage1 if k.startswith("model")) == ["model0", "model1"]
    assert stage1["args"].virtual_pipeline_model_parallel_size == 2
    # Megatron's interleaving: stage 1 holds global layers 1 (chunk 0) and 3 (chunk 1), both
    # under local index 0; the last chunk of the last stage carries the final norm and, with
    # tied embeddings, word_embeddings_for_head.
    assert StageLayout(4, 2, 2).layers(1, 0) == range(1, 2)
    assert StageLayout(4, 2, 2).layers(1, 1) == range(3, 4)
    chunk1 = stage1["model1"]
    assert "final_norm.weight" in chunk1["language_model"]["encoder"]
    assert chunk1["word_embeddings_for_head"]["weight"].shape == (128, 64)
    convert(ConvertOptions("megatron", "hf", vpp, back, verify=True))
    from safetensors.torch import load_file

    start, end = load_file(bloom_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(start) == sorted(end) and all(torch.equal(start[k], end[k]) for k in start)


def _megatron_qkv_by_loops(q, k, v, heads, groups, head_dim, tp):
    """Megatron's query_key_value rows per TP rank, built group by group with explicit loops."""
    per_rank = []
    groups_per_rank = groups // tp
    q_heads_per_group = heads // groups
    for rank in range(tp):
        rows = []
        for g in range(rank * groups_per_rank, (rank + 1) * groups_per_rank):
            for h in range(g * q_heads_per_group, (g + 1) * q_heads_per_group):
                rows.append(q[h * head_dim : (h + 1) * head_dim])
            rows.append(k[g * head_dim : (g + 1) * head_dim])
            rows.append(v[g * head_dim : (g + 1) * head_dim])
        per_rank.append(torch.cat(rows))
    return per_rank


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 2), (4, 2), (4, 4), (1, 1)])
def test_qkv_and_swiglu_layout_per_rank(kv_heads, tp):
    config = get_config("tiny-llama", num_kv_heads=kv_heads, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    d, h, e, f = config.head_dim, config.num_attention_heads, config.hidden_size, 128
    q, k, v = (torch.randn(n * d, e, generator=gen) for n in (h, kv_heads, kv_heads))
    gate, up = torch.randn(f, e, generator=gen), torch.randn(f, e, generator=gen)
    tensors = {
        "layers.0.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
        "layers.0.self_attn.o_proj.weight": torch.randn(e, h * d, generator=gen),
        "layers.0.mlp.gate_up_proj.weight": torch.cat([gate, up]),
        "layers.0.mlp.down_proj.weight": torch.randn(e, f, generator=gen),
        "layers.0.input_layernorm.weight": torch.randn(e, generator=gen),
        "layers.0.post_attention_layernorm.weight": torch.randn(e, generator=gen),
    }
    shards = layer_to_megatron(0, tensors, config, tp)
    expected = _megatron_qkv_by_loops(q, k, v, h, kv_heads, d, tp)
    for rank in range(tp):
        assert torch.equal(shards["self_attention.query_key_value.weight"][rank], expected[rank])
        rows = f // tp
        want = torch.cat(
            [gate[rank * rows : (rank + 1) * rows], up[rank * rows : (rank + 1) * rows]]
        )
        assert torch.equal(shards["mlp.dense_h_to_4h.weight"][rank], want)
        cols = h * d // tp
        o_proj = tensors["layers.0.self_attn.o_proj.weight"]
        assert torch.equal(
            shards["self_attention.dense.weight"][rank], o_proj[:, rank * cols : (rank + 1) * cols]
        )
    back = layer_from_megatron(0, shards, config)
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_tp_that_splits_a_query_group_is_refused(llama_dir, tmp_path):
    with pytest.raises(
        ValueError, match="num_kv_heads 2 is not divisible by --target-tensor-parallel-size 4"
    ):
        convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "tp4", target_tp=4))
    assert not (tmp_path / "tp4").exists()
    assert not list(tmp_path.iterdir())  # no partial directory left behind


def test_pipeline_size_must_divide_layers(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="target-pipeline-parallel-size 3"):
        convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "pp3", target_pp=3))
    assert not list(tmp_path.iterdir())
