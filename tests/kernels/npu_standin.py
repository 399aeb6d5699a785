"""A stand-in `torch_npu` module: the documented signatures, computed with plain PyTorch.

Every function binds its arguments to the prototype parsed from the installed wheel's docs
(`npu_contract.documented_ops`), checks the declared argument types and the values the docs
allow, records the call, and computes what the docs say the op computes. Installed as
`sys.modules["torch_npu"]`, it lets Meshline's NPU backends run on CPU, so a wrong layout, an
inverted mask or a misplaced argument shows as a numeric mismatch against the reference.
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.kernels import npu_contract

_SCALAR_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}
# npu_fusion_attention's compressed causal masks (sparse_mode 2, 3, 4, 7, 8) are this square.
COMPRESSED_MASK = 2048


def _check_types(name: str, proto: npu_contract.Prototype, bound: inspect.BoundArguments) -> None:
    for arg, value in bound.arguments.items():
        declared = proto.types[arg]
        optional = declared.endswith("?")
        base = declared.rstrip("?")
        if value is None:
            assert optional, f"{name}: {arg} ({declared}) is not optional but got None"
            continue
        if base == "Tensor":
            assert isinstance(value, torch.Tensor), f"{name}: {arg} must be a Tensor"
        elif base.endswith("[]"):
            assert isinstance(value, list | tuple), f"{name}: {arg} must be a list"
        elif base in _SCALAR_TYPES:
            ok = isinstance(value, _SCALAR_TYPES[base]) and not (
                base != "bool" and isinstance(value, bool)
            )
            assert ok, f"{name}: {arg} ({declared}) got {type(value).__name__}"


class StandIn(types.ModuleType):
    """The stand-in module; `calls` lists (op name, bound arguments) in call order."""

    def __init__(self, root: Path):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._ops = npu_contract.documented_ops(root)
        attention_doc = npu_contract.op_description(root, "npu_fusion_attention")
        layouts = re.search(r"支持((?:[A-Z]+、)+[A-Z]+)", attention_doc)
        assert layouts is not None, "input_layout choices not found in the docs"
        self.layouts = tuple(layouts.group(1).split("、"))
        modes = re.search(r"支持配置值为([\d、]+)", attention_doc)
        assert modes is not None, "sparse_mode choices not found in the docs"
        self.sparse_modes = tuple(int(m) for m in modes.group(1).split("、"))
        self.npu_rms_norm = self._documented("npu_rms_norm", _rms_norm)
        self.npu_rotary_mul = self._documented("npu_rotary_mul", _rotary_mul)
        self.npu_swiglu = self._documented("npu_swiglu", _swiglu)
        self.npu_fusion_attention = self._documented("npu_fusion_attention", self._attention)
        adamw_sig = npu_contract.optimizer_signature(root, "npu_fused_adamw", "NpuFusedAdamW")
        self.optim = types.SimpleNamespace(NpuFusedAdamW=self._optimizer(adamw_sig))

    def _documented(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        (proto,) = self._ops[name]

        def op(*args: Any, **kwargs: Any) -> Any:
            bound = proto.signature.bind(*args, **kwargs)
            _check_types(name, proto, bound)
            bound.apply_defaults()
            self.calls.append((name, dict(bound.arguments)))
            return impl(**bound.arguments)

        op.__name__ = name
        return op

    def _optimizer(self, signature: inspect.Signature) -> type[torch.optim.Optimizer]:
        calls = self.calls

        class NpuFusedAdamW(torch.optim.AdamW):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                calls.append(("optim.NpuFusedAdamW", dict(bound.arguments)))
                super().__init__(**bound.arguments)

        return NpuFusedAdamW

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        head_num: int,
        input_layout: str,
        pse: torch.Tensor | None,
        atten_mask: torch.Tensor | None,
        scale: float,
        keep_prob: float,
        pre_tockens: int,
        next_tockens: int,
        sparse_mode: int,
        **unused: Any,
    ) -> tuple[Any, ...]:
        """y = Softmax(Mask(scale·(pse + q·kᵀ), atten_mask)); out = y·v (keep_prob 1 only)."""
        assert input_layout in self.layouts, f"input_layout {input_layout!r} not documented"
        assert sparse_mode in self.sparse_modes, f"sparse_mode {sparse_mode} not documented"
        assert input_layout == "BSND", f"the stand-in computes BSND only, got {input_layout}"
        assert keep_prob == 1.0, "the stand-in computes without dropout"
        assert unused.get("padding_mask") is None, "padding_mask is documented as unsupported"
        batch, q_len, heads, _ = query.shape
        k_len, kv_heads = key.shape[1], key.shape[2]
        assert heads == head_num and heads % kv_heads == 0, "Nq/Nkv must be a non-zero integer"
        q = query.float().transpose(1, 2)
        k = key.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        v = value.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2)
        if pse is not None:
            assert pse.dtype == query.dtype, "query, key, value and pse must share a dtype"
            scores = scores + pse.float()
        scores = scores * scale
        masked = _mask(atten_mask, sparse_mode, pre_tockens, next_tockens, q_len, k_len)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_sum = torch.exp(scores - row_max).sum(-1, keepdim=True)
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).to(query.dtype)
        softmax_max = row_max.expand(batch, heads, q_len, 8).detach()
        softmax_sum = row_sum.expand(batch, heads, q_len, 8).detach()
        return out, softmax_max, softmax_sum, torch.empty(0), 0, 0, 0


def _mask(
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
    pre_tockens: int,
    next_tockens: int,
    q_len: int,
    k_len: int,
) -> torch.Tensor | None:
    """True = masked, as the docs define atten_mask, for the modes Meshline may use."""
    if atten_mask is None:
        return None  # docs: no mask given means full computation, whatever sparse_mode says
    assert atten_mask.dtype in (torch.bool, torch.uint8), "atten_mask must be bool or uint8"
    atten_mask = atten_mask.bool()
    q_pos = torch.arange(q_len)[:, None]
    k_pos = torch.arange(k_len)[None, :]
    if sparse_mode in (2, 3):
        expected = torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool).triu(1)
        assert atten_mask.shape == expected.shape and torch.equal(atten_mask.cpu(), expected), (
            f"sparse_mode {sparse_mode} takes the compressed 2048x2048 upper-triangular mask"
        )
        shift = 0 if sparse_mode == 2 else k_len - q_len  # left-up vs right-down origin
        return k_pos > q_pos + shift
    assert sparse_mode in (0, 1), f"the stand-in computes sparse_mode 0-3, got {sparse_mode}"
    assert atten_mask.dim() in (2, 4) and atten_mask.shape[-2:] == (q_len, k_len), (
        f"atten_mask must be SS/11SS/B1SS/BNSS of ({q_len}, {k_len}), got {atten_mask.shape}"
    )
    if sparse_mode == 0:
        # pre/next_tockens bound a band around the diagonal; it must agree with the mask.
        band = (k_pos > q_pos + next_tockens) | (k_pos < q_pos - pre_tockens)
        assert not (band & ~atten_mask).any(), "pre/next_tockens disagree with atten_mask"
    return atten_mask


def _rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[Any, Any]:
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def _rotary_mul(
    input: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str,
    rotate: torch.Tensor | None,
) -> torch.Tensor:
    assert rotary_mode == "half" and rotate is None, "the stand-in computes the half mode"
    first, second = input.chunk(2, dim=-1)
    return input * r1 + torch.cat((-second, first), dim=-1) * r2


def _swiglu(self: torch.Tensor, dim: int) -> torch.Tensor:
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b
