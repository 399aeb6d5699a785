"""Speculative decoding: draft k tokens cheaply, verify them in one target forward of k+1 positions.

Shapes: S verified positions (k+1), V vocab.

A row about to feed its pending token p drafts d1..dk — by prompt lookup (the tokens that followed
the latest earlier occurrence of the sequence's last n-gram in prompt + output) or by a small
draft model with the same vocabulary. The target runs [p, d1..dk] at the row's position in one
forward and gets logits for the k+1 next tokens. Position j is picked exactly as a plain step
would pick it (repetition penalty, warping, greedy or a draw, logprobs, stop checks), with one
change for sampled rows: the draft token d is kept with probability min(1, p(d)/q(d)), else the
token is drawn from max(0, p − q) renormalised (Leviathan et al. 2023, Chen et al. 2023; a
prompt-lookup draft has q one-hot on d). The first rejection ends the step with that corrected
token; when all k are kept, position k gives one more token. So greedy output is the plain
greedy output token for token, and sampled output has the target's distribution exactly (not
the same draws: a row's generator is consumed differently).

The KV cache then holds p and the kept drafts; the rejected positions are rolled back by
truncating the row's length (`TargetRows.truncate`). The engine's KV layout is reached only
through `TargetRows`, four calls on one row: its length, a one-token decode, a forward of
several tokens, a truncation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.sampling import SamplingConfig, warp
from engine.speculative_config import SpeculativeConfig
from engine.tokens import TokenizerInfo
from models.kv_cache import KVCache
from models.transformer import CausalLM

log = logging.getLogger(__name__)

Pick = Callable[[torch.Tensor, int | None, torch.Tensor | None], tuple[int, bool]]
"""The engine's pick at one verified position: (logits [1, V], draft token or None, draft
probabilities q [V] or None) -> (token it emitted, whether the sequence ended)."""


class TargetRows(Protocol):
    """What speculation needs from the target's KV cache, one row at a time."""

    def row_length(self, row: int) -> int:
        """Tokens cached in `row`."""
        ...

    def decode_one(self, row: int, token: int) -> torch.Tensor:
        """Logits [1, V] after feeding `token` to `row` (the fast one-token path)."""
        ...

    def forward_tokens(self, row: int, ids: list[int]) -> torch.Tensor:
        """Logits [S, V] of every position after feeding `ids` to `row` at its length."""
        ...

    def truncate(self, row: int, length: int) -> None:
        """Forget every cached position of `row` from `length` on."""
        ...


class AdaptedRows:
    """`TargetRows` of a runner whose row runs with one LoRA slot (0: the base model): the
    draft is verified by the very model the request asked for, adapter delta included."""

    def __init__(self, runner: AdapterRows, adapter: int) -> None:
        self.runner = runner
        self.adapter = adapter

    def row_length(self, row: int) -> int:
        return self.runner.row_length(row)

    def decode_one(self, row: int, token: int) -> torch.Tensor:
        return self.runner.decode_one(row, token, self.adapter)

    def forward_tokens(self, row: int, ids: list[int]) -> torch.Tensor:
        return self.runner.forward_tokens(row, ids, self.adapter)

    def truncate(self, row: int, length: int) -> None:
        self.runner.truncate(row, length)


class AdapterRows(Protocol):
    """`TargetRows` whose one-row calls take a LoRA slot (engine/model_runner.py)."""

    def row_length(self, row: int) -> int: ...

    def decode_one(self, row: int, token: int, adapter: int = 0) -> torch.Tensor: ...

    def forward_tokens(self, row: int, ids: list[int], adapter: int = 0) -> torch.Tensor: ...

    def truncate(self, row: int, length: int) -> None: ...


def truncate_cache(cache: KVCache, row: int, length: int) -> None:
    """Roll row `row` of a contiguous KVCache back to `length` positions (its later slots are
    masked out, so a later step of rows of unequal length never reads them)."""
    assert not cache.is_ring, "a sliding-window ring cannot roll back"
    assert 0 <= length <= int(cache.lengths_B[row])
    cache.lengths_B[row] = length
    cache.key_mask_BS[row, length:] = False


def ngram_draft(context: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, the latest earlier occurrence of the last
    n tokens of `context`, and up to k tokens that followed it; [] when none occurs."""
    size = len(context)
    if k < 1 or size < n_min + 1:
        return []
    ids = np.asarray(context, dtype=np.int64)
    # Candidate starts of an n-gram ending where the last token occurs earlier.
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = ids[size - n :]
        for end in ends[::-1]:  # latest first: the most recent context is the likeliest
            start = end - n + 1
            if start < 0:
                break  # earlier ends only start further left
            if np.array_equal(ids[start : end + 1], suffix):
                return ids[end + 1 : end + 1 + k].tolist()
    return []


def accept_or_resample(
    processed_V: torch.Tensor,
    draft: int,
    q_V: torch.Tensor | None,
    generator: torch.Generator,
) -> int:
    """The rejection rule at one position of a sampled row: `draft` with probability
    min(1, p(d)/q(d)), else a draw from max(0, p − q) renormalised; p = softmax of the
    processed logits, q = the draft's probabilities ([V]; None: one-hot on `draft`)."""
    p_V = processed_V.float().softmax(dim=-1)
    q_d = 1.0 if q_V is None else float(q_V[draft])
    u = float(torch.rand((), generator=generator, device=p_V.device))
    if u * q_d < float(p_V[draft]):
        return draft
    if q_V is None:
        residual_V = p_V.clone()
        residual_V[draft] = 0.0
    else:
        residual_V = (p_V - q_V.to(p_V)).clamp(min=0.0)
    if float(residual_V.sum()) <= 0.0:  # p <= q everywhere only when p == q up to rounding
        residual_V = p_V
    return int(torch.multinomial(residual_V, 1, generator=generator)[0])


def check_same_vocabulary(
    target: TokenizerInfo, target_vocab: int, draft: TokenizerInfo, draft_vocab: int, where: str
) -> None:
    """ValueError unless the draft model's vocabulary is the target's: same embedding rows and,
    where both checkpoints hold a tokenizer, the same special ids and the same token strings."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"{where}: the draft model has {draft_vocab} vocabulary rows, the served model "
            f"{target_vocab}; a draft model must share the served model's tokenizer"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        if draft.tokenizer is None and target.tokenizer is not None:
            log.warning("%s: the draft checkpoint holds no tokenizer; only sizes compared", where)
        return
    for name in ("eos_id", "bos_id", "pad_id"):
        mine, theirs = getattr(target, name), getattr(draft, name)
        if mine != theirs:
            raise ValueError(
                f"{where}: the draft tokenizer's {name} is {theirs}, the served model's {mine}; "
                "a draft model must share the served model's tokenizer"
            )
    size = target.tokenizer.vocab_size
    if draft.tokenizer.vocab_size != size:
        raise ValueError(
            f"{where}: the draft tokenizer has {draft.tokenizer.vocab_size} tokens, the served "
            f"model's {size}; a draft model must share the served model's tokenizer"
        )
    ids = list(range(size))
    mine_pieces, their_pieces = target.pieces(ids), draft.pieces(ids)
    if mine_pieces != their_pieces:
        first = next(i for i in ids if mine_pieces[i] != their_pieces[i])
        raise ValueError(
            f"{where}: token {first} is {their_pieces[first]!r} in the draft tokenizer and "
            f"{mine_pieces[first]!r} in the served model's; a draft model must share its tokenizer"
        )


class DraftModel:
    """A small model drafting for each sequence from a KV cache of its own (one row each)."""

    def __init__(self, model: CausalLM, max_seq_len: int, k: int) -> None:
        if model.config.sliding_window is not None:
            raise ValueError(
                "--speculative-config: the draft model has a sliding window; its cache cannot "
                "roll back rejected tokens"
            )
        self.model = model.eval()
        self.device = next(model.parameters()).device
        context = int(getattr(model.config, "context_length", model.config.max_position_embeddings))
        self.capacity = min(max_seq_len + k, context)
        """Most positions a draft cache holds (the target's length plus a draft)."""
        self.caches: dict[Hashable, KVCache] = {}

    def retain(self, keys: set[Hashable]) -> None:
        """Free the caches of sequences not in `keys` (they finished or left)."""
        for key in [key for key in self.caches if key not in keys]:
            del self.caches[key]

    def propose(
        self,
        key: Hashable,
        context: list[int],
        k: int,
        config: SamplingConfig,
        generator: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """k tokens after `context`: greedy, or drawn from the draft's warped distribution q
        with the row's generator; (tokens, q [k, V] for a sampled row, else None). The draft
        cache then holds `context` and the first k-1 drafted tokens."""
        cache = self.caches.get(key)
        if cache is None:
            size = min(self.capacity, len(context) + config.max_new_tokens + k)
            cache = KVCache.for_model(self.model, 1, size)
            self.caches[key] = cache
        done = int(cache.lengths_B[0])
        k = min(k, cache.max_seq_len - len(context) + 1)
        if k < 1 or done >= len(context):
            return [], None
        feed = context[done:]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            ids_1S = torch.tensor([feed], device=self.device)
            logits_V = self.model(ids_1S, kv_cache=cache, logits_to_keep=1)[0, -1].float()
            if generator is None:
                token = int(logits_V.argmax())
            else:
                q_V = warp(logits_V[None], [config])[0].softmax(dim=-1)
                token = int(torch.multinomial(q_V, 1, generator=generator)[0])
                probs.append(q_V)
            tokens.append(token)
            feed = [token]
        # The last drafted token was never fed: the cache holds context + tokens[:-1].
        return tokens, torch.stack(probs) if probs else None

    def keep(self, key: Hashable, length: int) -> None:
        """Roll a sequence's draft cache back to its first `length` positions."""
        cache = self.caches.get(key)
        if cache is not None and int(cache.lengths_B[0]) > length:
            truncate_cache(cache, 0, length)


@dataclass
class SpeculationStats:
    """Counters since start (read by the service's metrics)."""

    verifications: int = 0
    """Target forwards that verified a draft."""
    drafted: int = 0
    """Draft tokens proposed (and verified)."""
    accepted: int = 0
    """Draft tokens the target kept."""
    plain_steps: int = 0
    """Row steps that found no draft and decoded one token."""


class Speculator:
    """Drafts and verifies for each speculating row of an engine step."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None) -> None:
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError("Speculator: a draft model comes with method 'draft_model' only")
        self.config = config
        self.draft_model = draft_model
        self.stats = SpeculationStats()

    def applies(self, rows: int) -> bool:
        """Whether a step of `rows` active rows speculates (disable_by_batch_size)."""
        limit = self.config.disable_by_batch_size
        return limit is None or rows < limit

    def retain(self, keys: set[Hashable]) -> None:
        """Forget the draft state of sequences not in `keys`."""
        if self.draft_model is not None:
            self.draft_model.retain(keys)

    def step_row(
        self,
        target: TargetRows,
        row: int,
        key: Hashable,
        context: list[int],
        budget: int,
        config: SamplingConfig,
        generator: torch.Generator | None,
        pick: Pick,
    ) -> int | None:
        """One step of one row whose pending token is `context[-1]` (not yet cached): draft at
        most `budget` tokens, verify, emit through `pick`, roll back what was rejected. Returns
        the row's next pending token, or None once its sequence ended."""
        k = min(self.config.num_speculative_tokens, budget)
        q_KV: torch.Tensor | None = None
        if self.draft_model is not None:
            draft, q_KV = self.draft_model.propose(key, context, k, config, generator)
        else:
            draft = ngram_draft(
                context, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max
            )
        pending = context[-1]
        if not draft:
            self.stats.plain_steps += 1
            token, ended = pick(target.decode_one(row, pending), None, None)
            return None if ended else token
        length = target.row_length(row)
        logits_SV = target.forward_tokens(row, [pending, *draft])
        accepted = 0
        ended = False
        token = pending
        for j in range(len(draft) + 1):
            proposal = draft[j] if j < len(draft) else None
            q_V = q_KV[j] if q_KV is not None and proposal is not None else None
            token, ended = pick(logits_SV[j : j + 1], proposal, q_V)
            if token != proposal:
                break
            accepted += 1
            if ended:
                break
        self.stats.verifications += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += accepted
        if ended:
            return None
        target.truncate(row, length + 1 + accepted)
        if self.draft_model is not None:
            self.draft_model.keep(key, len(context) + min(accepted, len(draft) - 1))
        return token
