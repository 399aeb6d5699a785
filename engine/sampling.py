"""Logits processors with Hugging Face semantics, vectorised over rows with per-row settings.

Shapes: B rows (sequences or beams), V vocab.

Order (as `transformers` builds it): repetition penalty, then — only when sampling — temperature,
top-k, top-p. A filtered logit becomes -inf, so softmax gives it probability exactly 0 and
`sample_rows` can never draw it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
MAX_SEED = 2**63 - 1
"""Largest request seed: sequence i of a request seeds its generator with seed + i, which must
stay inside the 64-bit range `torch.Generator.manual_seed` accepts (and inside int64, what JSON
clients and other languages' gRPC stubs can carry)."""


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings of one request after defaults are applied (HF `GenerationConfig` names).

    A plain value: `engine.validation.sampling_problems` judges it (every front and
    `Engine.submit` call it), so a front can build one from untrusted fields and report all
    their problems at once."""

    max_new_tokens: int = 64
    """Tokens to generate at most per sequence."""
    do_sample: bool = False
    """Draw from the distribution instead of taking the arg-max."""
    temperature: float = 1.0
    """Softmax temperature when sampling; 0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p when sampling; 1 disables."""
    num_beams: int = 1
    """Beam search width; 1 is greedy or sampling."""
    repetition_penalty: float = 1.0
    """CTRL penalty for tokens already in the prompt or output; 1 disables."""
    length_penalty: float = 1.0
    """Beam search: a finished hypothesis scores sum_logprob / length**length_penalty."""
    early_stopping: bool = False
    """Beam search: stop once num_beams hypotheses are finished."""
    num_return_sequences: int = 1
    """Sequences returned (independent samples, or the best beams)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a sequence ends once its text contains one; the text is cut before it."""
    seed: int = 0
    """Seed of the request's sampler (sequence i of a request uses seed + i)."""
    logprobs: int = 0
    """Most likely alternatives reported with each generated token (0: none; not with beams)."""
    grammar: str | None = None
    """Structured output: an llguidance grammar (engine/grammar.py) each sequence's tokens must
    match, every sequence with a matcher of its own; None leaves the output free. Not with beams."""

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn at random (temperature 0 falls back to greedy)."""
        return self.do_sample and self.temperature > 0


def apply_repetition_penalty(
    logits_BV: torch.Tensor, seen_ids: Sequence[torch.Tensor], penalty_B: Sequence[float]
) -> torch.Tensor:
    """HF `RepetitionPenaltyLogitsProcessor` per row: logits of seen tokens divided by the penalty
    when positive, multiplied when negative. `seen_ids[b]` holds row b's prompt and output ids."""
    out = logits_BV
    for row, (ids, penalty) in enumerate(zip(seen_ids, penalty_B, strict=True)):
        if penalty == 1.0 or ids.numel() == 0:
            continue
        if out is logits_BV:
            out = logits_BV.clone()
        picked = out[row].gather(0, ids)
        out[row].scatter_(0, ids, torch.where(picked < 0, picked * penalty, picked / penalty))
    return out


def apply_temperature(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """Logits divided by each row's temperature ([B], > 0)."""
    return logits_BV / temperature_B[:, None].to(logits_BV.dtype)


def top_k_filter(logits_BV: torch.Tensor, top_k_B: torch.Tensor, min_keep: int = 1) -> torch.Tensor:
    """Logits below each row's k-th largest set to -inf (k = 0 leaves the row as is); ties with
    the k-th value survive, as in HF `TopKLogitsWarper`."""
    vocab = logits_BV.shape[-1]
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(min=min_keep, max=vocab), vocab)
    if bool((k_B >= vocab).all()):
        return logits_BV
    sorted_BV = logits_BV.sort(dim=-1, descending=True).values
    kth_B1 = sorted_BV.gather(1, (k_B - 1)[:, None])
    return logits_BV.masked_fill(logits_BV < kth_B1, NEG_INF)


def top_p_filter(logits_BV: torch.Tensor, top_p_B: torch.Tensor, min_keep: int = 1) -> torch.Tensor:
    """Nucleus filtering as HF `TopPLogitsWarper`: drop the least likely tokens whose cumulative
    probability stays <= 1 - p, keeping at least `min_keep` per row (p = 1 leaves the row)."""
    if bool((top_p_B >= 1).all()):
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=False)
    cum_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted_BV = cum_BV <= (1 - top_p_B[:, None].to(cum_BV.dtype))
    drop_sorted_BV[:, -min_keep:] = False
    drop_sorted_BV &= (top_p_B < 1)[:, None]
    drop_BV = drop_sorted_BV.scatter(1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, NEG_INF)


def warp(
    logits_BV: torch.Tensor,
    configs: Sequence[SamplingConfig],
    min_keep: int = 1,
) -> torch.Tensor:
    """Temperature, top-k and top-p of each row's config (rows that do not sample pass through)."""
    if all(
        not c.sampling or (c.temperature == 1 and c.top_k == 0 and c.top_p >= 1) for c in configs
    ):  # greedy rows, or sampling the plain softmax (GRPO's default): no tensor, no device sync
        return logits_BV
    device = logits_BV.device
    temp_B = torch.tensor([c.temperature if c.sampling else 1.0 for c in configs], device=device)
    top_k_B = torch.tensor([c.top_k if c.sampling else 0 for c in configs], device=device)
    top_p_B = torch.tensor([c.top_p if c.sampling else 1.0 for c in configs], device=device)
    if bool((temp_B != 1).any()):
        logits_BV = apply_temperature(logits_BV, temp_B)
    logits_BV = top_k_filter(logits_BV, top_k_B, min_keep)
    return top_p_filter(logits_BV, top_p_B, min_keep)


ARGMAX_BLOCK = 64
BLOCKED_ARGMAX_MIN = 24_576
"""Logits (rows × vocab) from which `argmax_rows` goes by blocks on CPU. The blocked path costs
~30 µs whatever the size; torch's arg-max ~2 ns an element. Measured on the 2-core x86-64 box:
16,384 elements 41 vs 33 µs (torch's faster), 24,576 30 vs 50, 32,768 (8 rows × 4,096, or one
32k-vocabulary row) 31–45 vs 62–82."""


def argmax_rows(logits_BV: torch.Tensor) -> torch.Tensor:
    """`logits_BV.argmax(-1)`, the same index in every case (first maximum; first NaN if any).

    On CPU torch's arg-max over the last dim compares one element at a time (~2 ns each:
    0.6 ms per step at 8 rows and a 32k vocabulary, 2.8 ms at 152k), while `amax` runs
    vectorised. For large inputs, then: the max of each block of 64, the first block holding
    the row's maximum (arg-max over the block maxima), and the arg-max inside that block; a
    tail shorter than a block is compared after. amax and argmax both treat NaN as the
    largest value, so a row with NaN gets its first NaN's index, as argmax gives it.
    """
    b, v = logits_BV.shape
    if logits_BV.device.type != "cpu" or b * v < BLOCKED_ARGMAX_MIN or v < 2 * ARGMAX_BLOCK:
        return logits_BV.argmax(dim=-1)
    n = v // ARGMAX_BLOCK * ARGMAX_BLOCK
    blocks_BNK = logits_BV[:, :n].reshape(b, n // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_B = blocks_BNK.amax(-1).argmax(-1)
    inside_BK = blocks_BNK.gather(1, block_B[:, None, None].expand(b, 1, ARGMAX_BLOCK))[:, 0]
    index_B = block_B * ARGMAX_BLOCK + inside_BK.argmax(-1)
    if n == v:
        return index_B
    tail_BT = logits_BV[:, n:]
    tail_B = tail_BT.argmax(-1)
    head_best_B = logits_BV.gather(1, index_B[:, None])[:, 0]
    tail_best_B = tail_BT.gather(1, tail_B[:, None])[:, 0]
    # The tail comes after the blocks: it wins only with a larger value, or a NaN they lack.
    tail_wins_B = (tail_best_B > head_best_B) | (tail_best_B.isnan() & ~head_best_B.isnan())
    return torch.where(tail_wins_B, tail_B + n, index_B)


def sample_rows(
    logits_BV: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row: drawn with the row's generator from softmax(logits), or the arg-max
    where the generator is None. Returns ids [B].

    A draw is by inverse CDF: one uniform u from the row's generator, then the first token whose
    cumulative probability exceeds u times the row's total, for all sampled rows at once. That is
    exactly the categorical distribution, seeded per row, and costs one random number a row:
    `torch.multinomial` draws V exponentials a row (~0.3 ms a row at a 4k vocabulary on the
    2-core box, the larger part of a 32-row rollout step of a small model). A token of
    probability 0 is never drawn (its cumulative sum equals its predecessor's)."""
    sampled = [row for row, gen in enumerate(generators) if gen is not None]
    if len(sampled) < len(generators):
        next_B = argmax_rows(logits_BV)
    else:
        next_B = torch.empty(len(generators), dtype=torch.long, device=logits_BV.device)
    if not sampled:
        return next_B
    cdf_RV = logits_BV[sampled].double().softmax(dim=-1).cumsum(dim=-1)
    total_R = cdf_RV[:, -1]
    if not bool(torch.isfinite(total_R).all()):  # before any generator draws
        raise ValueError("sample_rows: a sampled row's probabilities are not finite (NaN logits)")
    u_R = torch.cat(
        [torch.rand(1, generator=generators[row], device=logits_BV.device) for row in sampled]
    ).double()
    # Strictly below the total (u * total can round up to it), so some token's sum exceeds it.
    target_R = torch.minimum(u_R * total_R, torch.nextafter(total_R, torch.zeros_like(total_R)))
    drawn_R = torch.searchsorted(cdf_RV, target_R[:, None], right=True)[:, 0]
    next_B[sampled] = drawn_R
    return next_B
