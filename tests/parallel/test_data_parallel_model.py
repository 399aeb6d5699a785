"""Shared by the data-parallel and checkpoint tests: a tiny causal LM and a deterministic training
step over a fixed global batch (no tests here).

The model is `models.build_model` on a shrunk "tiny-llama-gqa" once the models package provides
it; until then a test-local Llama-shaped stand-in with the same layout (`embed_tokens`,
`layers` keyed "0".."L-1", `norm`, `lm_head`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.data_parallel import clip_grad_norm_, no_sync

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 128, 32, 2, 4, 16
GLOBAL_BATCH, MICRO_BATCHES = 8, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x_BSE: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSE.shape
        q, k, v = self.qkv(self.attn_norm(x_BSE)).view(B, S, 3, HEADS, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x_BSE = x_BSE + self.out(attn.transpose(1, 2).reshape(B, S, HIDDEN))
        return x_BSE + self.down(F.silu(self.up(self.mlp_norm(x_BSE))))


class TinyLM(nn.Module):
    """Llama-shaped stand-in used until `models.build_model` exists."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids_BS)
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.norm(x))


def build_tiny_model(seed: int = 0) -> nn.Module:
    """The same initial weights on every rank for a given seed."""
    torch.manual_seed(seed)
    try:
        from models import build_model
        from models.registry import get_config
    except ImportError:
        return TinyLM()
    config = get_config(
        "tiny-llama-gqa",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        max_position_embeddings=SEQ,
    )
    model = build_model(config, device=torch.device("cpu"))
    model.init_weights(seed=seed)
    return model


def global_batch(step: int) -> torch.Tensor:
    """Token ids [GLOBAL_BATCH, SEQ + 1] for `step` (4 batches cycled: learnable), same on all ranks."""
    generator = torch.Generator().manual_seed(10_000 + step % 4)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay, so a wrong update anywhere shows in the parameters."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    scheduler: Any = None,
    random_batches: bool = False,
) -> list[float]:
    """Train on `steps` of the fixed global batch split over DP ranks; return the global losses.

    Each rank runs MICRO_BATCHES micro-batches of its share, the first under `no_sync`; the loss
    is a mean over equally many tokens per rank, so averaging over ranks gives the global mean.
    `random_batches` draws each step's batch from the global torch RNG (so a resume must restore
    it); otherwise the batch depends on the step number only.
    """
    losses = []
    for step in steps:
        batch_id = int(torch.randint(0, 4, ()).item()) if random_batches else step
        tokens = global_batch(batch_id).chunk(dp_size)[dp_rank]
        total = torch.zeros(())
        micro = tokens.chunk(MICRO_BATCHES)
        for index, chunk in enumerate(micro):
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1))
            loss = loss / MICRO_BATCHES
            if index < MICRO_BATCHES - 1:
                with no_sync(model):
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if dp_size > 1:
            dist.all_reduce(total)
            total /= dp_size
        losses.append(total.item())
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full plain tensor, keyed by its global name."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out
