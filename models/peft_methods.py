"""Parameter-efficient methods besides LoRA: BitFit and prefix tuning (P-tuning v2).

Shapes: B batch, S sequence, P prefix length, E hidden, H heads, K kv heads, D head dim.

- BitFit (Ben Zaken et al.): every weight matrix frozen; biases and norm parameters train.
- Prefix tuning / P-tuning v2 (Li & Liang; Liu et al.): each attention layer gets P trainable key
  and value vectors per kv head that every query attends to before its own context. The prefix
  keys are not rotated (they have no position), and the real tokens keep positions 0..S-1.

Both keep the base model's parameter names; the trainable tensors are the whole adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import LayerNorm, RMSNorm
from models.transformer import Attention

PEFT_METHODS = ("lora", "bitfit", "prefix")


def apply_bitfit(model: nn.Module) -> list[str]:
    """Freeze everything but biases and norm scales/shifts; returns the trainable names."""
    norms = {name for name, m in model.named_modules() if isinstance(m, (RMSNorm, LayerNorm))}
    trainable = []
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        keep = name.endswith(".bias") or owner in norms
        param.requires_grad_(keep)
        if keep:
            trainable.append(name)
    if not trainable:
        raise ValueError("--peft-method bitfit: the model has no biases or norm parameters")
    return trainable


class PrefixAttention(Attention):
    """`Attention` with trainable per-layer key/value prefixes (set up by `apply_prefix`)."""

    prefix_key: nn.Parameter
    prefix_value: nn.Parameter

    def prefix_key_value(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The [P, K, D] key and value prefixes of the KV heads this module computes (a
        tensor-parallel split replaces this with the rank's heads)."""
        return self.prefix_key, self.prefix_value

    def forward(
        self,
        x_BSE: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        key_padding_mask_BS: torch.Tensor | None,
        segment_ids_BS: torch.Tensor | None,
        cache: object | None,
    ) -> torch.Tensor:
        """`Attention.forward` whose keys/values are [prefix; context] (`extend_keys`): the
        same projections, backend and sliding window; the prefix is visible to every query
        within its window."""
        if cache is not None or segment_ids_BS is not None:
            raise ValueError(
                "--peft-method prefix: KV-cache decoding and packed sequences (segment ids) are "
                "not supported with prefixes; train without --reset-attention-mask/packing"
            )
        return super().forward(x_BSE, rope_cos_sin, key_padding_mask_BS, None, None)

    def extend_keys(
        self,
        k_BSKD: torch.Tensor,
        v_BSKD: torch.Tensor,
        key_padding_mask_BS: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[prefix; context] keys and values, the prefix always a real (unpadded) key."""
        b = k_BSKD.shape[0]
        prefix_key_PKD, prefix_value_PKD = self.prefix_key_value()
        p = prefix_key_PKD.shape[0]
        pk_BPKD = prefix_key_PKD.to(k_BSKD.dtype).expand(b, -1, -1, -1)
        pv_BPKD = prefix_value_PKD.to(v_BSKD.dtype).expand(b, -1, -1, -1)
        k_BSKD = torch.cat([pk_BPKD, k_BSKD], dim=1)
        v_BSKD = torch.cat([pv_BPKD, v_BSKD], dim=1)
        if key_padding_mask_BS is not None:
            ones_BP = key_padding_mask_BS.new_ones(b, p)
            key_padding_mask_BS = torch.cat([ones_BP, key_padding_mask_BS], dim=1)
        return k_BSKD, v_BSKD, key_padding_mask_BS


def apply_prefix(
    model: nn.Module, num_virtual_tokens: int, init_std: float = 0.02, seed: int = 0
) -> list[str]:
    """Freeze `model` and give each attention layer P trainable key/value prefixes."""
    if num_virtual_tokens <= 0:
        raise ValueError(f"--num-virtual-tokens must be positive, got {num_virtual_tokens}")
    for param in model.parameters():
        param.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        weight = module.o_proj.weight
        k, d = module.kv_size // module.head_dim, module.head_dim
        shape = (num_virtual_tokens, k, d)
        module.__class__ = PrefixAttention
        for leaf in ("prefix_key", "prefix_value"):
            init = torch.randn(shape, generator=gen) * init_std
            module.register_parameter(
                leaf, nn.Parameter(init.to(device=weight.device, dtype=weight.dtype))
            )
            names.append(f"{name}.{leaf}")
    if not names:
        raise ValueError("--peft-method prefix: the model has no attention layers")
    return names
