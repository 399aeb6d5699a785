"""Mixture-of-experts feed-forward: top-k router, capacity or dropless dispatch, auxiliary losses.

Shapes: B batch, S sequence, E hidden, N tokens (B·S), X experts, K top-k, F expert ffn width,
T routed token copies (N·K, fewer when capacity drops some).

Architecture only. Where the experts live is the dispatcher's business: `LocalDispatcher` runs
every expert in this process; the trainer's expert parallelism
(`parallel/expert_parallel.py`) swaps in one that sends token copies to the rank
holding their expert with all-to-all and keeps only that rank's experts here.

Parameter names and layouts match HF Mixtral (`mlp.gate.weight [X, E]`,
`mlp.experts.gate_up_proj [X, 2F, E]` rows [gate; up], `mlp.experts.down_proj [X, E, F]`).
Auxiliary losses (Switch/GShard load balancing, ST-MoE router z-loss) are added to the gradient
through `AuxLossInjector` (the training loop needs no change) and kept in `last_aux_loss` for
logging. They are formed from sums over the tokens (`aux_statistics`), which a parallel wrapper
whose ranks split a micro-batch's tokens sums over those ranks first (`reduce_aux_statistics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import activation as act
from models.mlp import MLP
from models.moe_config import MoEConfig


class AuxLossInjector(torch.autograd.Function):
    """Identity on the activations whose backward also sends d(aux)/d(aux) = `scale` into aux."""

    scale = 1.0
    """Set per step by the training loop (`set_aux_loss_scale`)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, AuxLossInjector.scale)


def set_aux_loss_scale(scale: float) -> None:
    """The gradient every auxiliary loss gets in backward: the training loop's loss scale over
    its micro-batches per step (Megatron's `MoEAuxLossAutoScaler.set_loss_scale`), so the aux
    losses enter the objective as their mean over all micro-batches of the step whatever the
    layout (data-parallel averaging divides by the ranks, this by the micro-batches)."""
    AuxLossInjector.scale = scale


class Experts(nn.Module):
    """X gated (SwiGLU) experts stored as stacked weights; `expert_offset` is the global id of
    expert 0 here (non-zero once expert parallelism keeps a slice)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.expert_offset = 0

    def forward(self, x_TE: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `x_TE` grouped by local expert (`counts[i]` rows for expert i) → outputs."""
        return expert_outputs(x_TE, counts, self.gate_up_proj, self.down_proj)


def expert_outputs(
    x_TE: torch.Tensor, counts: list[int], gate_up_XGE: torch.Tensor, down_XEF: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts on grouped rows: `counts[i]` rows of `x_TE` go through expert i's
    `gate_up_XGE[i]` (G = 2F rows, [gate; up]) and `down_XEF[i]`.

    Parallel wrappers call it with their slices: a tensor-parallel rank passes its gate and up
    rows (G = 2F/t) and its down columns, giving that rank's partial sum of the output.
    """
    outs = []
    # An expert with no tokens still runs on its empty chunk: its gradient is then zeros
    # rather than None, which data-parallel reductions expect.
    for i, chunk_TE in enumerate(x_TE.split(counts)):
        h = act.swiglu_packed(F.linear(chunk_TE, gate_up_XGE[i]))
        outs.append(F.linear(h, down_XEF[i]))
    return torch.cat(outs) if outs else x_TE


class LocalDispatcher:
    """Every expert is in this process: token copies go straight to `experts`."""

    def run(self, experts: Experts, x_TE: torch.Tensor, counts_X: torch.Tensor) -> torch.Tensor:
        """Outputs of the rows of `x_TE`, which are grouped by global expert id (counts_X)."""
        return experts(x_TE, counts_X.tolist())


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing a decoder layer's MLP."""

    def __init__(self, hidden: int, ffn: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden, ffn)
        self.shared_experts: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        if config.num_shared_experts:
            width = config.shared_expert_ffn or ffn * config.num_shared_experts
            self.shared_experts = MLP(hidden, width)
        self.dispatcher: Any = LocalDispatcher()
        self.reduce_aux_statistics: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums `aux_statistics` over the ranks that split a micro-batch's tokens (set by a
        parallel wrapper, e.g. context parallelism); None: this process holds them all."""
        self.last_aux_loss: torch.Tensor | None = None

    def route(self, x_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [N, X] fp32, top-k weights [N, K], top-k expert ids [N, K])."""
        # Through the module (not its weight) so parallel wrappers' hooks on `gate` apply.
        logits_NX = self.gate(x_NE).float()
        probs_NX = logits_NX.softmax(dim=-1)
        weights_NK, experts_NK = probs_NX.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return logits_NX, weights_NK, experts_NK

    def aux_loss(self, logits_NX: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """coeff·X·Σ_i f_i·P_i (f: share of routed copies, P: mean probability) + z-loss, over
        the micro-batch's tokens (all ranks' under `reduce_aux_statistics`)."""
        stats = self.aux_statistics(logits_NX, experts_NK)
        losses_on = self.config.aux_loss_coeff or self.config.z_loss_coeff
        if self.reduce_aux_statistics is not None and losses_on:
            stats = self.reduce_aux_statistics(stats)
        return self.aux_loss_from_statistics(stats)

    def aux_statistics(self, logits_NX: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """The sums the auxiliary losses are formed from, one fp32 vector [2X + 2]: routed copies
        per expert, router probability per expert summed over the tokens, Σ logsumexp(logits)²
        over the tokens, and the token count (zeros where a loss is off). Sums over disjoint
        token sets add up, so ranks splitting a micro-batch sum these to get its statistics."""
        cfg = self.config
        counts_X = logits_NX.new_zeros(cfg.num_experts)
        probs_X = logits_NX.new_zeros(cfg.num_experts)
        z = logits_NX.new_zeros(1)
        if cfg.aux_loss_coeff:
            counts_X = torch.bincount(experts_NK.flatten(), minlength=cfg.num_experts).float()
            probs_X = logits_NX.softmax(dim=-1).sum(dim=0)
        if cfg.z_loss_coeff:
            z = torch.logsumexp(logits_NX, dim=-1).square().sum()[None]
        n = logits_NX.new_full((1,), logits_NX.shape[0])
        return torch.cat([counts_X, probs_X, z, n])

    def aux_loss_from_statistics(self, stats: torch.Tensor) -> torch.Tensor:
        """The auxiliary losses from `aux_statistics` (of one rank's tokens, or summed)."""
        cfg = self.config
        counts_X, probs_X, z, n = stats.split([cfg.num_experts, cfg.num_experts, 1, 1])
        loss = stats.new_zeros(())
        if cfg.aux_loss_coeff:
            f_X = counts_X / (n * cfg.top_k)
            p_X = probs_X / n
            loss = loss + cfg.aux_loss_coeff * cfg.num_experts * (f_X * p_X).sum()
        if cfg.z_loss_coeff:
            loss = loss + cfg.z_loss_coeff * (z / n).squeeze(0)
        return loss

    def keep_mask(self, experts_NK: torch.Tensor) -> torch.Tensor:
        """Which routed copies fit their expert's capacity (earlier tokens first); all if dropless."""
        cfg = self.config
        if cfg.capacity_factor is None:
            return torch.ones_like(experts_NK, dtype=torch.bool)
        n = experts_NK.shape[0]
        capacity = math.ceil(cfg.capacity_factor * n * cfg.top_k / cfg.num_experts)
        onehot_NKX = F.one_hot(experts_NK, cfg.num_experts)
        # Position of each copy in its expert's queue, counting tokens in order (then k order).
        rank_NKX = onehot_NKX.flatten(0, 1).cumsum(dim=0).view_as(onehot_NKX) - 1
        rank_NK = (rank_NKX * onehot_NKX).sum(dim=-1)
        return rank_NK < capacity

    def routed_experts(
        self,
        x_NE: torch.Tensor,
        weights_NK: torch.Tensor,
        experts_NK: torch.Tensor,
        keep_NK: torch.Tensor,
    ) -> torch.Tensor:
        """Σ_k w_k · expert_k(x) per token over its kept copies (zeros for a token with none).

        The copies are grouped by expert and run by the dispatcher. Linear in the experts'
        outputs, so a tensor-parallel rank may pass partial outputs and reduce the result.
        """
        top_k, num_experts = self.config.top_k, self.config.num_experts
        flat_T = torch.where(keep_NK, experts_NK, num_experts).flatten()
        order_T = flat_T.argsort(stable=True)[: int(keep_NK.sum())]
        token_T = order_T // top_k
        counts_X = torch.bincount(flat_T[order_T], minlength=num_experts)
        y_TE = self.dispatcher.run(self.experts, x_NE[token_T], counts_X)
        # Summed in the input's dtype: under autocast the experts' outputs come in bf16/fp16
        # while the residual stream stays fp32.
        w_T = weights_NK.flatten()[order_T].to(x_NE.dtype)
        return torch.zeros_like(x_NE).index_add(0, token_T, y_TE.to(x_NE.dtype) * w_T[:, None])

    def attach_aux_loss(self, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """`out` unchanged, with `aux` reaching the gradient in backward (kept for logging)."""
        self.last_aux_loss = aux.detach()
        if self.training and aux.requires_grad:
            out = AuxLossInjector.apply(out, aux)
        return out

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for tokens `x` (any leading shape, hidden last), behind
        the sigmoid gate where there is one (Qwen2-MoE); None without shared experts."""
        if self.shared_experts is None:
            return None
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared

    def forward(self, x_BSE: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k · expert_k(x) over kept copies (+ shared experts), auxiliary losses attached."""
        b, s, e = x_BSE.shape
        x_NE = x_BSE.reshape(-1, e)
        logits_NX, weights_NK, experts_NK = self.route(x_NE)
        out_NE = self.routed_experts(x_NE, weights_NK, experts_NK, self.keep_mask(experts_NK))
        shared_NE = self.shared_output(x_NE)
        if shared_NE is not None:
            out_NE = out_NE + shared_NE
        out_NE = self.attach_aux_loss(out_NE, self.aux_loss(logits_NX, experts_NK))
        return out_NE.view(b, s, e)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE layer in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
