"""Families transformers does not ship, against references written from their published code.

`reference_logits` below is a from-scratch forward over HF-layout tensors, written from each
family's published modelling code, not from Meshline's model:

- Baichuan-7B: baichuan-inc/Baichuan-7B `modeling_baichuan.py` (fused `W_pack` = [q; k; v],
  RMSNorm in fp32, rotate-half RoPE with base 10000, SwiGLU MLP).
- Baichuan-13B / Baichuan2-13B: baichuan-inc/Baichuan-13B-Base `modeling_baichuan.py` (ALiBi:
  `_get_interleave` slopes, bias slope·j on key position j plus the future mask; no RoPE).
- Baichuan2: baichuan-inc/Baichuan2-7B-Base `modeling_baichuan.py` `NormHead`
  (logits = h · normalize(W)ᵀ, rows L2-normalised).
- InternLM: internlm/internlm-7b `modeling_internlm.py` (Llama with biases on q/k/v/o, `bias`).
- Aquila: BAAI/Aquila-7B `modeling_aquila.py` (the Llama architecture).

Each case also goes through `meshline convert` native → HF (Baichuan-13B/Baichuan2-13B with ALiBi
included, which could not be exported before) and back through Meshline's HF reader.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from engine.loading import load_checkpoint
from models import build_model
from models.hf_adapters import hf_config, to_hf
from models.registry import get_config
from services.converter.job import ConvertOptions, convert
from training.checkpoint import CheckpointManager, TrainState

CASES = {
    "baichuan-7B": ("tiny-baichuan", {}),
    "baichuan-13B-alibi": ("tiny-baichuan-alibi", {"hidden_size": 96, "num_attention_heads": 6}),
    "baichuan2-7B-normhead": ("tiny-baichuan", {"norm_head": True}),
    "baichuan2-13B-alibi-normhead": ("tiny-baichuan-alibi", {"norm_head": True}),
    "internlm": ("tiny-internlm", {}),
    "aquila": ("tiny-llama", {"family": "aquila"}),
}


def _get_interleave(n: int) -> list[float]:
    """Baichuan-13B's ALiBi slopes (`_get_interleave` in its modeling_baichuan.py)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _get_interleave(2 * closest)[0::2][: n - closest]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_logits(w: dict[str, torch.Tensor], hf: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of an HF-layout Baichuan / InternLM / Aquila checkpoint."""
    e, heads = hf["hidden_size"], hf["num_attention_heads"]
    d, eps = e // heads, hf["rms_norm_eps"]
    b, s = ids.shape
    x = w["model.embed_tokens.weight"][ids]
    alibi = hf.get("position_embedding") == "alibi"
    if alibi:
        slopes = torch.tensor(_get_interleave(heads))
        positions = torch.arange(s).float()
        bias = slopes[:, None, None] * positions[None, None, :]  # slope · j
    else:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(s).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    future = torch.full((s, s), float("-inf")).triu(1)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if p + "self_attn.W_pack.weight" in w:
            q, k, v = F.linear(h, w[p + "self_attn.W_pack.weight"]).split(e, dim=-1)
        else:
            q, k, v = (
                F.linear(
                    h, w[f"{p}self_attn.{n}_proj.weight"], w.get(f"{p}self_attn.{n}_proj.bias")
                )
                for n in "qkv"
            )
        q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2)
        if alibi:
            scores = scores / math.sqrt(d) + bias + future
        else:
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            scores = q @ k.transpose(-1, -2) / math.sqrt(d) + future
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, e)
        x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = F.linear(h, w[p + "mlp.gate_proj.weight"])
        up = F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"]
    if hf.get("norm_head"):
        head = F.normalize(head)  # Baichuan2 NormHead
    return x @ head.T


def _model(case: str):
    name, overrides = CASES[case]
    config = get_config(name, num_layers=2, **overrides)
    model = build_model(config, device="cpu")
    model.init_weights(seed=5)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0 if param.shape[0] == config.hidden_size else 0.0, 0.2)
            else:
                param.mul_(6.0)  # std 0.12: logits far from uniform
    return config, model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_published_code_reference(case, tmp_path):
    config, model = _model(case)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    weights = to_hf(model.state_dict(), config)
    with torch.no_grad():
        expected = reference_logits(weights, hf_config(config), ids)
        assert (model(ids) - expected).abs().max().item() <= 5e-5

    # native → HF export (ALiBi Baichuan included), read back by Meshline's HF reader.
    CheckpointManager(tmp_path / "run", model_config=config.to_dict()).save(
        1, TrainState(model, save_rng=False)
    )
    convert(ConvertOptions("native", "hf", tmp_path / "run", tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == config.family
    loaded = load_checkpoint(tmp_path / "hf", load_format="hf")
    assert loaded.config.position_embedding == config.position_embedding
    assert loaded.config.norm_head == config.norm_head
    with torch.no_grad():
        assert (loaded.model(ids) - expected).abs().max().item() <= 5e-5


def test_reference_slopes_cover_non_power_of_two_heads():
    # Baichuan-13B has 40 heads: 32 from the power-of-two sequence, 8 interleaved from 64.
    slopes = _get_interleave(40)
    assert len(slopes) == 40 and slopes[0] == 2 ** (-8 / 32)
    assert slopes[32] == 2 ** (-8 / 64)
