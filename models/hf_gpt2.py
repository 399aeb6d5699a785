"""Megatron's GPT (family "gpt") ↔ transformers' GPT-2 (`GPT2LMHeadModel`): config and names.

Name map (layer i; Meshline ↔ HF, HF's Conv1D weights are stored [in, out], so every projection
weight is transposed; biases are not):

| Meshline | GPT-2 |
|---|---|
| embed_tokens | transformer.wte |
| embed_positions | transformer.wpe |
| layers.i.input_layernorm | transformer.h.i.ln_1 |
| layers.i.self_attn.qkv_proj ([q; k; v]) | transformer.h.i.attn.c_attn (transposed) |
| layers.i.self_attn.o_proj | transformer.h.i.attn.c_proj (transposed) |
| layers.i.post_attention_layernorm | transformer.h.i.ln_2 |
| layers.i.mlp.up_proj | transformer.h.i.mlp.c_fc (transposed) |
| layers.i.mlp.down_proj | transformer.h.i.mlp.c_proj (transposed) |
| norm | transformer.ln_f |
| lm_head | lm_head (absent when tied) |

Checkpoints saved from `GPT2Model` (the original `gpt2` release) lack the `transformer.` prefix;
`from_hf` reads both. GPT-2 has one key/value head per query head, biases on every projection,
LayerNorm and learned absolute positions: a config without them raises naming the field.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig

if TYPE_CHECKING:
    import torch

# Torch only in the weight mappings: the config mapping is read by the torch-free layout checks
# that refuse a parallel size before the CLIs import torch.
StateDict = dict[str, "torch.Tensor"]

ACTIVATION_FROM_HF = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu": "gelu_exact",
}
"""GPT-2 `activation_function` → ModelConfig.activation (tanh approximation or exact erf)."""
ACTIVATION_TO_HF = {"gelu": "gelu_new", "gelu_exact": "gelu"}

_TOP = {
    "embed_tokens": "transformer.wte",
    "embed_positions": "transformer.wpe",
    "norm": "transformer.ln_f",
}
_LAYER_NAMES = {
    "input_layernorm": "ln_1",
    "self_attn.qkv_proj": "attn.c_attn",
    "self_attn.o_proj": "attn.c_proj",
    "post_attention_layernorm": "ln_2",
    "mlp.up_proj": "mlp.c_fc",
    "mlp.down_proj": "mlp.c_proj",
}
_CONV1D = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^h\.(\d+)\.(.+)\.(weight|bias)$")


def _unsupported(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config_from_hf: {field}={value!r} changes the model and {why}")


def config_from_gpt2(hf: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a GPT-2 config.json (math-changing values it cannot honour raise)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATION_FROM_HF:
        raise _unsupported(
            "activation_function", act, f"only {sorted(ACTIVATION_FROM_HF)} are supported"
        )
    if not hf.get("scale_attn_weights", True):
        raise _unsupported("scale_attn_weights", False, "is not supported (scores unscaled)")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            raise _unsupported(key, True, "is not supported")
    hidden = hf["n_embd"]
    return dict(
        family="gpt",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"],
        norm_type="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding="learned",
        activation=ACTIVATION_FROM_HF[act],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        fused_gate_up=False,
        init_std=hf.get("initializer_range", 0.02),
        attention_dropout=float(hf.get("attn_pdrop", 0.0)),
        extra=extra,
    )


def gpt2_config(config: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 config.json keys for `config` (`common`: the keys every family writes)."""
    bad = []
    if config.norm_type != "layernorm" or config.embedding_layernorm:
        bad.append(f"norm_type={config.norm_type!r}")
    if config.position_embedding != "learned":
        bad.append(f"position_embedding={config.position_embedding!r}")
    if config.activation not in ACTIVATION_TO_HF:
        bad.append(f"activation={config.activation!r}")
    if not (config.attention_bias and config.mlp_bias) or config.qkv_bias:
        bad.append(f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias}")
    if config.kv_heads != config.num_attention_heads:
        bad.append(f"num_kv_heads={config.kv_heads}")
    if config.kv_channels is not None and config.kv_channels * config.num_attention_heads != (
        config.hidden_size
    ):
        bad.append(f"kv_channels={config.kv_channels}")
    for name in ("qk_norm", "norm_head", "sliding_window", "moe"):
        if getattr(config, name):
            bad.append(f"{name}={getattr(config, name)!r}")
    if bad:
        raise ValueError(
            f"hf_config: {', '.join(bad)} cannot be expressed by HF GPT2LMHeadModel "
            f"(family {config.family!r}); GPT-2 has LayerNorm, learned positions, GeLU, biases "
            "on every projection and one key/value head per query head"
        )
    return {
        **common,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "n_positions": config.max_position_embeddings,
        "n_ctx": config.max_position_embeddings,
        "activation_function": ACTIVATION_TO_HF[config.activation],
        "layer_norm_epsilon": config.norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "attn_pdrop": config.attention_dropout,
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
    }


def gpt2_to_hf(canon: StateDict, config: ModelConfig) -> StateDict:
    """Meshline names (q/k/v unfused) → GPT-2 names, Conv1D weights transposed."""
    import torch

    out: StateDict = {}
    for name, tensor in canon.items():
        if name.startswith("lm_head."):
            if not config.tie_word_embeddings:
                out[name] = tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            module, _, leaf = name.rpartition(".")
            out[f"{_TOP[module]}.{leaf}"] = tensor
            continue
        layer, module, leaf = match.groups()
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            continue
        if module == "self_attn.q_proj":
            tensor = torch.cat(
                [canon[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            )
            module = "self_attn.qkv_proj"
        if leaf == "weight" and module in _CONV1D:
            tensor = tensor.t().contiguous()
        out[f"transformer.h.{layer}.{_LAYER_NAMES[module]}.{leaf}"] = tensor
    return out


def gpt2_from_hf(hf_state: StateDict, config: ModelConfig) -> StateDict:
    """GPT-2 names (with or without `transformer.`) → Meshline names, q/k/v fused as [q; k; v]."""
    top = {hf.removeprefix("transformer."): ours for ours, hf in _TOP.items()}
    layer_names = {hf: ours for ours, hf in _LAYER_NAMES.items()}
    q = config.num_attention_heads * config.head_dim
    out: StateDict = {}
    for full, tensor in hf_state.items():
        name = full.removeprefix("transformer.")
        if name.endswith(("attn.bias", "attn.masked_bias")) and _HF_LAYER.match(name) is None:
            continue  # the causal-mask buffers old checkpoints carry
        if name.startswith("lm_head."):
            out[name] = tensor
            continue
        match = _HF_LAYER.match(name)
        if match is None:
            module, _, leaf = name.rpartition(".")
            if module not in top:
                raise ValueError(f"from_hf: unexpected GPT-2 tensor {full!r}")
            out[f"{top[module]}.{leaf}"] = tensor
            continue
        layer, module, leaf = match.groups()
        if module not in layer_names:
            if module == "attn" and leaf == "bias":
                continue  # attn.bias: the causal-mask buffer
            raise ValueError(f"from_hf: unexpected GPT-2 tensor {full!r}")
        ours = layer_names[module]
        if leaf == "weight" and ours in _CONV1D:
            tensor = tensor.t().contiguous()
        if ours == "self_attn.qkv_proj" and not config.fused_qkv:
            for proj, part in zip("qkv", tensor.split([q, q, q]), strict=True):
                out[f"layers.{layer}.self_attn.{proj}_proj.{leaf}"] = part
            continue
        out[f"layers.{layer}.{ours}.{leaf}"] = tensor
    if config.tie_word_embeddings and "embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["embed_tokens.weight"])
    return out
