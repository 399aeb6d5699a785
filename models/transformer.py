"""One generic causal decoder covering the Llama, Qwen, Mistral and Bloom families (see
`ModelConfig`: biases, explicit head dim, q/k norms, sliding windows and RoPE scalings are config),
dense or mixture-of-experts (`ModelConfig.moe`: every layer's MLP is a `models.moe.MoE`).

Shapes: B batch, S sequence, E hidden, H heads, K kv heads, D head dim, F ffn, V vocab.

Architecture only: no process groups, no parallel code. Layers live in a `ModuleDict` keyed by
their global index ("0".."L-1") so that a pipeline stage keeps the names the full model has; a
stage without `embed_tokens` takes hidden states, one without `lm_head` returns them.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from kernels.attention import alibi_slopes, attention
from kernels.norm import LayerNorm, RMSNorm
from kernels.rotary import RopeScaling, RotaryEmbedding, apply_rotary, rotary_qkv
from models.config import ModelConfig
from models.kv_cache import CacheStep, KVCache
from models.mlp import MLP
from models.moe import MoE


def build_norm(config: ModelConfig) -> nn.Module:
    """The family's normalisation layer over the hidden size."""
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.norm_eps)
    return LayerNorm(config.hidden_size, eps=config.norm_eps, bias=True)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with RoPE or ALiBi (optionally q/k-normed and
    windowed)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d = config.hidden_size, config.head_dim
        h, k = config.num_attention_heads, config.kv_heads
        self.head_dim = d
        self.dropout = config.attention_dropout
        self.q_size, self.kv_size = h * d, k * d
        qkv_bias = config.attention_bias or config.qkv_bias
        if config.fused_qkv:
            self.qkv_proj = nn.Linear(e, (h + 2 * k) * d, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(e, h * d, bias=qkv_bias)
            self.k_proj = nn.Linear(e, k * d, bias=qkv_bias)
            self.v_proj = nn.Linear(e, k * d, bias=qkv_bias)
        self.o_proj = nn.Linear(h * d, e, bias=config.attention_bias)
        # Qwen3: RMSNorm over each head's D before RoPE (one [D] scale shared by all heads).
        self.q_norm = RMSNorm(d, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, eps=config.norm_eps) if config.qk_norm else None
        self.window = config.sliding_window
        self.fused = config.fused_qkv
        self.alibi = config.position_embedding == "alibi"
        # ALiBi slopes depend on the head's global index: a tensor-parallel split that keeps heads
        # [head_offset, head_offset + local heads) sets head_offset (the plan's "alibi_heads").
        self.num_heads_total = h
        self.head_offset = 0
        self._slopes: dict[torch.device, torch.Tensor] = {}
        # kernels.attention backend for training/prefill (None: the device's default); the
        # trainer sets it from --attention-backend / --triangle-attn / --use-flash-attn.
        self.attention_backend: str | None = None

    def alibi_slopes_H(self, local_heads: int, device: torch.device) -> torch.Tensor:
        """fp32 ALiBi slopes of the heads this module holds (computed, never stored as state)."""
        if device not in self._slopes:
            self._slopes[device] = alibi_slopes(self.num_heads_total).to(device)
        return self._slopes[device][self.head_offset : self.head_offset + local_heads]

    def forward(
        self,
        x_BSE: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        key_padding_mask_BS: torch.Tensor | None,
        segment_ids_BS: torch.Tensor | None,
        cache: tuple[KVCache, CacheStep, str] | None,
    ) -> torch.Tensor:
        """Self-attention over x (plus cached keys when `cache` is given)."""
        q_BSHD, k_BSKD, v_BSKD = self._project(x_BSE, rope_cos_sin)
        if cache is not None:
            # Incremental decoding (inference, no attention dropout): the cache stores this step's
            # keys/values and attends over every key the queries see.
            kv_cache, step, layer_id = cache
            slopes_H = self.alibi_slopes_H(q_BSHD.shape[2], q_BSHD.device) if self.alibi else None
            cached_BSHD = kv_cache.attend(
                layer_id, step, q_BSHD, k_BSKD, v_BSKD, slopes_H, self.window
            )
            return self.o_proj(cached_BSHD.flatten(2))
        k_BSKD, v_BSKD, key_padding_mask_BS = self.extend_keys(k_BSKD, v_BSKD, key_padding_mask_BS)
        out_BSHD = attention(
            q_BSHD,
            k_BSKD,
            v_BSKD,
            causal=True,
            alibi_slopes_H=self.alibi_slopes_H(q_BSHD.shape[2], q_BSHD.device)
            if self.alibi
            else None,
            key_padding_mask_BS=key_padding_mask_BS,
            segment_ids_BS=segment_ids_BS,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.attention_backend,
            window=self.window,
        )
        assert isinstance(out_BSHD, torch.Tensor)  # no return_lse: a single tensor
        return self.o_proj(out_BSHD.flatten(2))

    def extend_keys(
        self,
        k_BSKD: torch.Tensor,
        v_BSKD: torch.Tensor,
        key_padding_mask_BS: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values and key mask the queries attend over: this call's own (a subclass puts
        trainable prefixes before them, models/peft_methods.py; queries then sit at the end)."""
        return k_BSKD, v_BSKD, key_padding_mask_BS

    def _project(
        self, x_BSE: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated when RoPE) and v. Head counts are read from the projection widths, so a
        tensor-parallel shard that holds only its heads works unchanged."""
        b, s, _ = x_BSE.shape
        d = self.head_dim
        if not self.fused:
            q_BSHD = self.q_proj(x_BSE).view(b, s, -1, d)
            k_BSKD = self.k_proj(x_BSE).view(b, s, -1, d)
            v_BSKD = self.v_proj(x_BSE).view(b, s, -1, d)
            if self.q_norm is not None and self.k_norm is not None:
                q_BSHD, k_BSKD = self.q_norm(q_BSHD), self.k_norm(k_BSKD)
            if rope_cos_sin is not None:
                q_BSHD = apply_rotary(q_BSHD, *rope_cos_sin)
                k_BSKD = apply_rotary(k_BSKD, *rope_cos_sin)
            return q_BSHD, k_BSKD, v_BSKD
        qkv = self.qkv_proj(x_BSE).view(b, s, -1, d)
        heads = qkv.shape[2] * self.q_size // (self.q_size + 2 * self.kv_size)
        kv_heads = (qkv.shape[2] - heads) // 2
        # With RoPE, v is the only view that attention would save of qkv while training: it is
        # copied out rather than pinning the whole output.
        if rope_cos_sin is not None and (self.q_norm is None or self.k_norm is None):
            # q and k rotated together (on the CPU while training: one pass that also writes
            # v out, kernels/cpu/fused.py).
            q_BSHD, k_BSKD, v_BSKD = rotary_qkv(qkv, *rope_cos_sin, heads, kv_heads)
            return q_BSHD, k_BSKD, v_BSKD.contiguous() if self.training else v_BSKD
        qk_BSXD, v_BSKD = qkv.split([heads + kv_heads, kv_heads], dim=2)
        if self.q_norm is not None and self.k_norm is not None:
            q_BSHD, k_BSKD = qk_BSXD.split([heads, kv_heads], dim=2)
            qk_BSXD = torch.cat([self.q_norm(q_BSHD), self.k_norm(k_BSKD)], dim=2)
        if rope_cos_sin is not None:
            qk_BSXD = apply_rotary(qk_BSXD, *rope_cos_sin)
            if self.training:
                v_BSKD = v_BSKD.contiguous()
        q_BSHD, k_BSKD = qk_BSXD.split([heads, kv_heads], dim=2)
        return q_BSHD, k_BSKD, v_BSKD


def build_mlp(config: ModelConfig) -> nn.Module:
    """The layer's feed-forward: an MoE block when `config.moe` is set, else the dense MLP."""
    if config.moe is not None:
        return MoE(config.hidden_size, config.ffn_hidden_size, config.moe)
    return MLP(
        config.hidden_size,
        config.ffn_hidden_size,
        activation=config.activation,
        bias=config.mlp_bias,
        fused_gate_up=config.fused_gate_up,
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        self.input_layernorm = build_norm(config)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = build_mlp(config)
        self.dropout = config.hidden_dropout

    def forward(
        self,
        x_BSE: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_padding_mask_BS: torch.Tensor | None = None,
        segment_ids_BS: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_step: CacheStep | None = None,
    ) -> torch.Tensor:
        """One decoder block; `kv_cache` and `cache_step` come together (incremental decode)."""
        cache = None if kv_cache is None else (kv_cache, cache_step, self.layer_id)
        attn = self.self_attn(
            self.input_layernorm(x_BSE), rope_cos_sin, key_padding_mask_BS, segment_ids_BS, cache
        )
        h_BSE = x_BSE + self._dropout(attn)
        mlp = self.mlp(self.post_attention_layernorm(h_BSE))
        return h_BSE + self._dropout(mlp)

    def _dropout(self, x_BSE: torch.Tensor) -> torch.Tensor:
        # Skipped outright in eval: a decode step would otherwise pay two no-op calls per layer.
        if self.training and self.dropout > 0:
            return F.dropout(x_BSE, self.dropout, True)
        return x_BSE


def positions_from_segments(segment_ids_BS: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 where each packed document (segment) begins."""
    b, s = segment_ids_BS.shape
    index_BS = torch.arange(s, device=segment_ids_BS.device).expand(b, s)
    starts_BS = torch.ones_like(segment_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]
    first_BS = torch.where(starts_BS, index_BS, torch.zeros_like(index_BS)).cummax(dim=1).values
    return index_BS - first_BS


class CausalLM(nn.Module):
    """Token embedding → decoder layers → final norm → output head (each optional per stage)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        # Learned absolute positions (GPT-2, Megatron's learned_absolute): a table added to the
        # token embeddings; it lives with them (the first pipeline stage).
        self.embed_positions: nn.Embedding | None = None
        if config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embed_layernorm = build_norm(config) if config.embedding_layernorm else None
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, i) for i in range(config.num_layers)}
        )
        self.norm: nn.Module | None = build_norm(config)
        self.lm_head: nn.Linear | None = nn.Linear(
            config.hidden_size, 1 if config.value_head else config.vocab_size, bias=False
        )
        self.tie_weights()
        self.rotary = self._build_rotary(config)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the head when the config ties them and both exist.

        `to_empty` gives every parameter fresh storage and so unties them; `init_weights` calls
        this again, and so should anyone who loads weights after `to_empty` without it.
        """
        tie = self.config.tie_word_embeddings
        # a quantized embedding (kernels/quant_embedding.py) has no float weight: serving ties
        # its codes to the head itself (engine/quantized_model.py)
        plain = isinstance(getattr(self.embed_tokens, "weight", None), torch.Tensor)
        if tie and plain and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _build_rotary(config: ModelConfig) -> RotaryEmbedding | None:
        if config.position_embedding != "rope":
            return None
        scaling = None
        if config.rope_scaling is not None:
            scaling = RopeScaling.from_dict(config.rope_scaling)
        return RotaryEmbedding(config.head_dim, theta=config.rope_theta, scaling=scaling)

    def forward(
        self,
        x: torch.Tensor,
        *,
        position_ids_BS: torch.Tensor | None = None,
        key_padding_mask_BS: torch.Tensor | None = None,
        segment_ids_BS: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_step: CacheStep | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B,S,V] (hidden [B,S,E] without a head) for token ids [B,S] (hidden, no embed).

        `key_padding_mask_BS` marks real tokens (True) of this call's tokens; `segment_ids_BS`
        separates packed documents (positions then restart per document unless given); with
        `kv_cache` the tokens are appended to the cached ones; `cache_step`, a step the caller
        began on `kv_cache` (and commits after the call), keeps the cache's host-side planning
        out of a compiled forward. `logits_to_keep` n > 0 returns the logits of the last n
        positions only (HF's argument of that name; a stage without a head returns every
        position): a prefill needs one row of logits, not S, and the final norm and head then
        run on those rows alone.
        """
        h_BSE = self.embed_tokens(x) if self.embed_tokens is not None else x
        b, s = h_BSE.shape[:2]
        step = cache_step
        if kv_cache is None and cache_step is not None:
            raise ValueError("CausalLM.forward: cache_step needs the kv_cache it was begun on")
        if kv_cache is not None:
            if segment_ids_BS is not None:
                raise ValueError(
                    "CausalLM.forward: segment_ids_BS cannot be combined with kv_cache"
                )
            if step is None:
                step = kv_cache.begin(s, key_padding_mask_BS)
        if position_ids_BS is None and (
            self.rotary is not None or self.embed_positions is not None
        ):
            position_ids_BS = self._default_positions(b, s, h_BSE.device, segment_ids_BS, step)
        if self.embed_tokens is not None:
            if self.embed_positions is not None:
                h_BSE = h_BSE + self.embed_positions(position_ids_BS)
            if self.embed_layernorm is not None:
                h_BSE = self.embed_layernorm(h_BSE)
        rope = None
        if self.rotary is not None:
            rope = self.rotary(position_ids_BS)
        for layer in self.layers.values():
            h_BSE = layer(h_BSE, rope, key_padding_mask_BS, segment_ids_BS, kv_cache, step)
        if kv_cache is not None and step is not None and cache_step is None:
            kv_cache.commit(step)
        if logits_to_keep > 0 and self.lm_head is not None:
            h_BSE = h_BSE[:, -logits_to_keep:]
        if self.norm is not None:
            h_BSE = self.norm(h_BSE)
        if self.lm_head is None:
            return h_BSE
        if self.config.norm_head:
            return F.linear(h_BSE, F.normalize(self.lm_head.weight, dim=-1))
        return self.lm_head(h_BSE)

    @staticmethod
    def _default_positions(
        b: int,
        s: int,
        device: torch.device,
        segment_ids_BS: torch.Tensor | None,
        step: CacheStep | None,
    ) -> torch.Tensor:
        """0..S-1, restarted per packed document, or continuing each cached row."""
        if segment_ids_BS is not None:
            return positions_from_segments(segment_ids_BS)
        index_BS = torch.arange(s, device=device).expand(b, s)
        return index_BS if step is None else step.start_B[:, None] + index_BS

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter (also after `to_empty`, which leaves memory uninitialised).

        Weight matrices and embeddings ~ N(0, init_std), biases 0, norm scales 1 — the HF
        convention. With `seed`, each parameter draws from its own generator seeded by (seed,
        global name), so a pipeline stage gets exactly the values the whole model would (a tied
        head copy takes the embedding's). A sharded (DTensor) parameter draws its whole tensor, one
        parameter at a time, and keeps its shard: the values of the unsharded model. None draws
        from the global RNG (DTensor-friendly).
        """
        self.tie_weights()
        std = self.config.init_std
        for module_name, module in self.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                if isinstance(module, (RMSNorm, LayerNorm)):
                    nn.init.constant_(param, 1.0 if leaf == "weight" else 0.0)
                elif leaf == "bias":
                    nn.init.zeros_(param)
                else:
                    name = f"{module_name}.{leaf}"
                    if name == "lm_head.weight" and self.config.tie_word_embeddings:
                        name = "embed_tokens.weight"
                    gen = None if seed is None else _generator(seed, name, param.device)
                    if gen is not None and isinstance(param, DTensor):
                        whole = torch.empty(param.shape, dtype=param.dtype, device=param.device)
                        nn.init.normal_(whole, mean=0.0, std=std, generator=gen)
                        mine = distribute_tensor(
                            whole, param.device_mesh, param.placements, src_data_rank=None
                        )
                        param.to_local().copy_(mine.to_local())
                    else:
                        nn.init.normal_(param, mean=0.0, std=std, generator=gen)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator seeded by (seed, parameter name), independent of which modules exist."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def build_model(
    config: ModelConfig,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """Construct a CausalLM on `device` in `dtype`; on a real device it is initialised at once.

    The one builder of every family, dense or MoE (`config.moe`); callers use `models.build_model`.

    On "meta" nothing is allocated: call `model.to_empty(device=...)` then `init_weights()`.
    """
    device = torch.device(device)
    with torch.device(device):
        model = CausalLM(config)
    model.to(dtype=dtype)
    if device.type != "meta":
        model.init_weights()
    return model
