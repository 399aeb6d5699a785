"""The one-token decode forward without per-module dispatch: the engine's default decode step.

Shapes: B rows, E hidden, H heads, K kv heads, D head dim, V vocab (one new token per row).

A decode step of a small model is bound by fixed per-call costs, not by arithmetic: the module
forward spends most of a hidden-256 step in `nn.Module.__call__`, kernel-registry look-ups, the
attention front end's request checks and no-op dtype casts, around ~300 dispatched ops (HF's
`generate` ~335). `DecodeStep` runs the same computation as `CausalLM.forward` for one token per
row over the model's own parameters (nothing is copied): the same kernels (the ones the kernel
registry picked for this process, resolved once here), the same torch calls in the same order,
so its logits are bit-identical to the module forward's (tested) — only the Python between the
kernels is gone.

It covers the decoder the common families share: token embedding, pre-norm RMSNorm layers,
RoPE without "dynamic" scaling, fused or separate q/k/v (biases and Qwen3's q/k norms
included), SwiGLU MLP (fused or not), a final RMSNorm and an untied or tied plain head, with the
SDPA attention backend and plain (oneDNN-packed, or weight-only quantized) linear layers.
`DecodeStep.build` returns None with the reason for anything else (ALiBi, sliding windows,
MoE, LoRA, tensor-parallel shards, hooks, another attention backend...), and the engine keeps
the module forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config_support import FieldSupport, declined, every, only
from kernels.activation import SWIGLU, SWIGLU_PACKED
from kernels.attention import ATTENTION
from kernels.attention.sdpa import folds_query_groups, grouped_single_query
from kernels.norm import RMS_NORM, RMSNorm, rms_norm_reference
from kernels.packed_linear import PackedLinear
from kernels.quant_embedding import QuantEmbedding
from kernels.quant_linear import QuantLinear
from kernels.rotary import APPLY_ROTARY, apply_rotary_reference, inverse_frequencies
from models.kv_cache import CacheStep, KVCache
from models.transformer import MLP, Attention, CausalLM, DecoderLayer

Linear = Callable[[torch.Tensor], torch.Tensor]

_SIZE = "a size the step reads from the weights"
_TRAINING = "training only (the step runs in eval mode)"
LEAN_SUPPORT: dict[str, FieldSupport] = {
    "family": every("the family names the HF layout; the step reads the modules"),
    "vocab_size": every(_SIZE),
    "hidden_size": every(_SIZE),
    "num_layers": every(_SIZE),
    "num_attention_heads": every(_SIZE),
    "num_kv_heads": every("grouped kv heads as the sdpa backend runs them"),
    "ffn_hidden_size": every(_SIZE),
    "max_position_embeddings": every("bounds the cache, not the step"),
    "norm_type": only("rmsnorm", why="the step calls the RMSNorm kernel only"),
    "norm_eps": every("read from each norm"),
    "position_embedding": only(
        "rope", why="the step rotates q and k; ALiBi biases and learned positions are not in it"
    ),
    "rope_theta": every("read from the model's rotary table"),
    "rope_scaling": FieldSupport(
        lambda value: value is None or value.get("type") != "dynamic",
        "dynamic RoPE scaling changes the frequencies with the length",
    ),
    "activation": only("swiglu", why="the step calls the SwiGLU kernels only"),
    "attention_bias": every("biases of plain linear layers are applied"),
    "qkv_bias": every("biases of plain linear layers are applied"),
    "kv_channels": every("the explicit head width is read"),
    "qk_norm": every("Qwen3's per-head q/k RMSNorm is applied"),
    "sliding_window": only(None, why="the step attends over every cached key"),
    "mlp_bias": every("biases of plain linear layers are applied"),
    "tie_word_embeddings": every("a tied head is the same plain linear layer"),
    "embedding_layernorm": only(False, why="no norm after the token embedding"),
    "norm_head": only(False, why="the head's rows are not normalised"),
    "value_head": only(False, why="a reward model's scalar head is not a vocabulary head"),
    "fused_qkv": every("fused or separate q/k/v"),
    "fused_gate_up": every("fused or separate gate/up"),
    "init_std": every(_TRAINING),
    "attention_dropout": every(_TRAINING),
    "hidden_dropout": every(_TRAINING),
    "moe": only(None, why="dense MLPs only"),
    "extra": every("metadata the model never reads"),
}
"""The lean step's row for every ModelConfig field (engine/config_support.py)."""


class Unsupported(Exception):
    """The model has a part the decode step does not cover (the module forward runs instead)."""


@dataclass(frozen=True)
class StepLayer:
    """One decoder layer's parameters, read once from its modules."""

    key: str
    norm1: tuple[torch.Tensor, float]
    norm2: tuple[torch.Tensor, float]
    qkv: Linear | None
    q: Linear | None
    k: Linear | None
    v: Linear | None
    o: Linear
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    q_size: int
    kv_size: int
    gate_up: Linear | None
    gate: Linear | None
    up: Linear | None
    down: Linear


class DecodeStep:
    """`model(ids_B1, kv_cache=cache, cache_step=step, logits_to_keep=1)[:, -1]`, leaner."""

    def __init__(self, model: CausalLM) -> None:
        config = model.config
        reason = declined(config, LEAN_SUPPORT)
        if reason is not None:
            raise Unsupported(reason)
        self.config = config
        if model.training:
            raise Unsupported("the model is in training mode")
        if model.embed_tokens is None or model.lm_head is None or model.norm is None:
            raise Unsupported("a pipeline stage (no embedding, final norm or head)")
        embed = model.embed_tokens
        if type(embed) not in (nn.Embedding, QuantEmbedding) or model.embed_layernorm is not None:
            raise Unsupported("the embedding is not a plain nn.Embedding (or a quantized one)")
        if model.rotary is None:  # the table declines every configuration without RoPE
            raise Unsupported("no rotary table")
        scaling = model.rotary.scaling
        if scaling is not None and scaling.kind == "dynamic":
            raise Unsupported("dynamic RoPE scaling (the frequencies depend on the length)")
        # The CPU "fused" backend runs sdpa for every call outside a training step.
        if ATTENTION.default() not in ("sdpa", "fused"):
            raise Unsupported(f"attention backend {ATTENTION.default()!r} (this step mirrors sdpa)")
        _no_hooks(model)
        self.embedding: torch.Tensor | QuantEmbedding = (
            embed if isinstance(embed, QuantEmbedding) else embed.weight
        )
        """The table (a quantized one dequantizes the rows it is asked for)."""
        self.dtype = embed.dtype if isinstance(embed, QuantEmbedding) else embed.weight.dtype
        """The dtype of the rows, hidden states and logits."""
        device = embed.scale.device if isinstance(embed, QuantEmbedding) else embed.weight.device
        self.final_norm = _norm(model.norm)
        self.head = _linear(model.lm_head)
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.inv_freq = inverse_frequencies(config.head_dim, model.rotary.theta, scaling).to(device)
        self.rope_scale = model.rotary.scale
        # The kernels the registry chose for this process (what the module forward calls).
        self.rms_norm = RMS_NORM.get(RMS_NORM.default())
        self.rotate = APPLY_ROTARY.get(APPLY_ROTARY.default())
        self.swiglu = SWIGLU.get(SWIGLU.default())
        self.swiglu_packed = SWIGLU_PACKED.get(SWIGLU_PACKED.default())
        self.layers = [_read_layer(key, layer) for key, layer in model.layers.items()]
        if (
            self.dtype == torch.float32
            and self.rms_norm is rms_norm_reference
            and self.rotate is apply_rotary_reference
        ):
            # fp32 under the reference kernels: the same ops minus their no-op fp32 casts.
            self.rms_norm, self.rotate = _rms_norm_fp32, _rotate_fp32

    @classmethod
    def build(cls, model: CausalLM) -> tuple[DecodeStep | None, str]:
        """The step for `model`, or None and why the module forward must run instead."""
        try:
            return cls(model), "covered"
        except Unsupported as exc:
            return None, str(exc)

    def __call__(self, ids_B1: torch.Tensor, cache: KVCache, step: CacheStep) -> torch.Tensor:
        """Logits [B, V] of one new token per row, written into `cache` at `step` (begun on
        `cache` by the caller, who commits it afterwards)."""
        mask_B11S = None if step.key_mask_BS is None else step.key_mask_BS[:, None, None, :]

        def attend(
            layer: StepLayer, q_B1HD: torch.Tensor, k_B1KD: torch.Tensor, v_B1KD: torch.Tensor
        ) -> torch.Tensor:
            k_all, v_all = cache.write(layer.key, step, k_B1KD, v_B1KD)
            return self._attention(q_B1HD, k_all, v_all, mask_B11S)

        return self._forward(ids_B1, step.start_B, attend)

    def static(self, ids_B1: torch.Tensor, cache: KVCache, rows: int, key_len: int) -> torch.Tensor:
        """The step for rows [0, rows) of `cache` with no host read and no shape that changes
        from one step to the next, so a CUDA graph can capture it (engine/cuda_graphs.py).

        Each row's position is read on the device from `cache.lengths_B`; its key and value
        are scattered there; attention reads the first `key_len` slots (a fixed bucket at least
        as long as every row after this step) under the cache's key mask; the step commits
        itself (mask and lengths advance in place). Logits [rows, V] equal `__call__`'s up to
        the order of the attention's reduction (the masked slots add exact zeros).
        """
        pos_B = cache.lengths_B[:rows]
        slots_S = torch.arange(key_len, device=pos_B.device)
        new_BS = slots_S[None, :] == pos_B[:, None]
        mask_B11S = (cache.key_mask_BS[:rows, :key_len] | new_BS)[:, None, None, :]
        pos_B1 = pos_B[:, None]

        def attend(
            layer: StepLayer, q_B1HD: torch.Tensor, k_B1KD: torch.Tensor, v_B1KD: torch.Tensor
        ) -> torch.Tensor:
            k_cache = cache.k_BSKD[layer.key][:rows]
            v_cache = cache.v_BSKD[layer.key][:rows]
            index_B1KD = pos_B1[:, :, None, None].expand_as(k_B1KD)
            k_cache.scatter_(1, index_B1KD, k_B1KD)
            v_cache.scatter_(1, index_B1KD, v_B1KD)
            return self._attention(q_B1HD, k_cache[:, :key_len], v_cache[:, :key_len], mask_B11S)

        logits_BV = self._forward(ids_B1, pos_B, attend)
        cache.key_mask_BS[:rows].scatter_(1, pos_B1, True)
        cache.lengths_B[:rows] += 1  # last: pos_B and pos_B1 are views of these lengths
        return logits_BV

    def _forward(
        self,
        ids_B1: torch.Tensor,
        pos_B: torch.Tensor,
        attend: Callable[[StepLayer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The decoder over one token per row at positions `pos_B`; `attend(layer, q, k, v)`
        stores k/v and returns attention's output [B, H, 1, D]."""
        b = ids_B1.shape[0]
        if isinstance(self.embedding, QuantEmbedding):
            h_B1E = self.embedding(ids_B1)
        else:
            h_B1E = F.embedding(ids_B1, self.embedding)
        freqs_B1d = pos_B[:, None, None].float() * self.inv_freq
        emb_B1D = torch.cat((freqs_B1d, freqs_B1d), dim=-1)
        cos_B1D, sin_B1D = emb_B1D.cos(), emb_B1D.sin()
        if self.rope_scale != 1.0:
            cos_B1D, sin_B1D = cos_B1D * self.rope_scale, sin_B1D * self.rope_scale
        d = self.head_dim
        for layer in self.layers:
            x_B1E = self.rms_norm(h_B1E, *layer.norm1)
            q_B1HD, k_B1KD, v_B1KD = self._project(layer, x_B1E, cos_B1D, sin_B1D, b, d)
            out_BH1D = attend(layer, q_B1HD, k_B1KD, v_B1KD)
            h_B1E = h_B1E + layer.o(out_BH1D.transpose(1, 2).flatten(2))
            x_B1E = self.rms_norm(h_B1E, *layer.norm2)
            if layer.gate_up is not None:
                act_B1F = self.swiglu_packed(layer.gate_up(x_B1E))
            else:
                assert layer.gate is not None and layer.up is not None
                act_B1F = self.swiglu(layer.gate(x_B1E), layer.up(x_B1E))
            h_B1E = h_B1E + layer.down(act_B1F)
        return self.head(self.rms_norm(h_B1E, *self.final_norm))[:, -1]

    def _attention(
        self,
        q_B1HD: torch.Tensor,
        k_BSKD: torch.Tensor,
        v_BSKD: torch.Tensor,
        mask_B11S: torch.Tensor | None,
    ) -> torch.Tensor:
        """One query per row over the keys given: out [B, H, 1, D] (grouped kv heads on CPU
        as the sdpa backend runs them: G queries per kv head, no repeated keys)."""
        q_BH1D = q_B1HD.transpose(1, 2)
        if folds_query_groups(q_BH1D, k_BSKD.shape[2], mask_B11S):
            return grouped_single_query(
                q_BH1D, k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2), mask_B11S, self.scale
            )
        return F.scaled_dot_product_attention(
            q_B1HD.transpose(1, 2),
            k_BSKD.transpose(1, 2),
            v_BSKD.transpose(1, 2),
            attn_mask=mask_B11S,
            dropout_p=0.0,
            is_causal=False,
            scale=self.scale,
            enable_gqa=q_B1HD.shape[2] != k_BSKD.shape[2],
        )

    def _project(
        self,
        layer: StepLayer,
        x_B1E: torch.Tensor,
        cos_B1D: torch.Tensor,
        sin_B1D: torch.Tensor,
        b: int,
        d: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k rotated, and v: `Attention._project` for one token per row."""
        if layer.qkv is None:
            assert layer.q is not None and layer.k is not None and layer.v is not None
            q = layer.q(x_B1E).view(b, 1, -1, d)
            k = layer.k(x_B1E).view(b, 1, -1, d)
            v = layer.v(x_B1E).view(b, 1, -1, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self.rms_norm(q, *layer.q_norm), self.rms_norm(k, *layer.k_norm)
            return (
                self.rotate(q, cos_B1D, sin_B1D, False),
                self.rotate(k, cos_B1D, sin_B1D, False),
                v,
            )
        qkv = layer.qkv(x_B1E).view(b, 1, -1, d)
        heads = qkv.shape[2] * layer.q_size // (layer.q_size + 2 * layer.kv_size)
        kv_heads = (qkv.shape[2] - heads) // 2
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=2)
            qk = torch.cat([self.rms_norm(q, *layer.q_norm), self.rms_norm(k, *layer.k_norm)], 2)
        q, k = self.rotate(qk, cos_B1D, sin_B1D, False).split([heads, kv_heads], dim=2)
        return q, k, v


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` for fp32 x and weight (its casts are identities there)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_fp32(
    x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """`apply_rotary_reference` (not interleaved) for fp32 x and fp32 cos/sin."""
    assert not interleaved
    half = x_BSHD.shape[-1] // 2
    rotated = torch.cat((-x_BSHD[..., half:], x_BSHD[..., :half]), dim=-1)
    return x_BSHD * cos_BSD.unsqueeze(2) + rotated * sin_BSD.unsqueeze(2)


def _read_layer(key: str, layer: nn.Module) -> StepLayer:
    if type(layer) is not DecoderLayer:
        raise Unsupported(f"layer {key} is a {type(layer).__name__}")
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not MLP:
        raise Unsupported(f"layer {key}: attention or MLP of another kind (MoE?)")
    if attn.alibi or attn.window is not None:
        raise Unsupported(f"layer {key}: ALiBi or a sliding window")
    if mlp.activation != "swiglu":
        raise Unsupported(f"layer {key}: activation {mlp.activation!r}")
    q_norm = k_norm = None
    if attn.q_norm is not None and attn.k_norm is not None:
        q_norm, k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
    fused_qkv, fused_mlp = attn.fused, mlp.fused
    return StepLayer(
        key=key,
        norm1=_norm(layer.input_layernorm),
        norm2=_norm(layer.post_attention_layernorm),
        qkv=_linear(attn.qkv_proj) if fused_qkv else None,
        q=None if fused_qkv else _linear(attn.q_proj),
        k=None if fused_qkv else _linear(attn.k_proj),
        v=None if fused_qkv else _linear(attn.v_proj),
        o=_linear(attn.o_proj),
        q_norm=q_norm,
        k_norm=k_norm,
        q_size=attn.q_size,
        kv_size=attn.kv_size,
        gate_up=_linear(mlp.gate_up_proj) if fused_mlp else None,
        gate=None if fused_mlp else _linear(mlp.gate_proj),
        up=None if fused_mlp else _linear(mlp.up_proj),
        down=_linear(mlp.down_proj),
    )


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    if type(module) is not RMSNorm:
        raise Unsupported(f"a {type(module).__name__} norm (RMSNorm only)")
    return module.weight, module.eps


class DenseLinear:
    """F.linear on a plain nn.Linear's parameters, which stay readable (engine/native_step.py)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _linear(module: nn.Module) -> Linear:
    """The layer as a call: F.linear on a plain nn.Linear's parameters, a packed or quantized
    layer itself."""
    if isinstance(module, (PackedLinear, QuantLinear)):
        return module  # a quantized layer's forward; NativeStep reads its codes
    if type(module) is not nn.Linear:
        raise Unsupported(f"a {type(module).__name__} linear layer (LoRA, quantised or sharded)")
    return DenseLinear(module.weight, module.bias)


def _no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            raise Unsupported(f"module {name or 'model'} has forward hooks")
