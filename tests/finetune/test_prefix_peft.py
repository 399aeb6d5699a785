"""Prefix tuning against peft's `PrefixTuningConfig` on a tiny HF Llama (GQA), fp32.

peft feeds the prefixes as a KV cache, so HF places the real tokens at positions P..P+S-1;
with those positions Meshline's prefix attention gives peft's logits within 1e-5. With the
trainer's positions 0..S-1 the logits differ (RoPE is relative only among rotated keys)."""

from __future__ import annotations

import torch
from peft import PrefixTuningConfig, get_peft_model

from models import build_model
from models.hf_adapters import from_hf
from models.peft_methods import PrefixAttention, apply_prefix
from models.registry import get_config
from tests.models.test_hf_parity import _randomise, hf_model_for

P = 3


def test_prefix_logits_equal_peft_prefix_tuning():
    config = get_config("tiny-llama-gqa")
    hf = hf_model_for(config)
    _randomise(hf, 0)
    ours = build_model(config, device="cpu")
    ours.load_state_dict(from_hf(hf.state_dict(), config), strict=False)
    peft_model = get_peft_model(hf, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=P))
    names = apply_prefix(ours.eval(), P)
    assert len(names) == 2 * config.num_layers
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == set(names)
    # peft's table [P, L·2·K·D] is, per layer l, keys at 2l and values at 2l + 1.
    table = peft_model.prompt_encoder["default"].embedding.weight.detach()
    table = table.view(P, config.num_layers * 2, config.kv_heads, config.head_dim)
    with torch.no_grad():
        for layer in range(config.num_layers):
            attn = ours.layers[str(layer)].self_attn
            assert isinstance(attn, PrefixAttention)
            attn.prefix_key.copy_(table[:, 2 * layer])
            attn.prefix_value.copy_(table[:, 2 * layer + 1])
    x = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(P, P + 10).expand(2, 10)
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=x).logits
        got = ours(x, position_ids_BS=positions)
    assert (got - expected).abs().max().item() <= 1e-5


def test_prefix_attention_keeps_the_sliding_window_and_the_backend(monkeypatch):
    """PrefixAttention is `Attention.forward` with [prefix; context] keys: a windowed model's
    queries see only their window (prefix included), through the layer's chosen backend."""
    from kernels import attention as kernels_attention
    from models import transformer

    config = get_config("tiny-mistral")  # sliding window 8
    model = build_model(config, device="cpu").eval()
    apply_prefix(model, P)
    attn = model.layers["0"].self_attn
    assert isinstance(attn, PrefixAttention)
    attn.attention_backend = "reference"
    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs["window"], kwargs["backend"], args[1].shape[1]))
        return kernels_attention.attention(*args, **kwargs)

    monkeypatch.setattr(transformer, "attention", spy)
    x = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        windowed = model(x)
        assert seen[0] == (8, "reference", P + 12)
        for layer in model.layers.values():
            layer.self_attn.window = None
        assert (model(x) - windowed).abs().max().item() > 1e-4  # the window changes the result
