"""Continuation log-probabilities (what multiple-choice evaluation needs), batched.

Shapes: B items in a batch, S padded length (context + continuation), C continuation length,
V vocab.

Items whose context no other item shares are batched as context ids + continuation ids,
right-padded to the batch's longest; one forward without a cache gives, at position t, the
distribution of token t + 1. A continuation of length C starting at position P is scored by the
log-softmax rows P-1 .. P+C-2.

Items that share a context (the choices of one multiple-choice question) run that context once:
its forward fills row 0 of a KV cache and gives the first continuation token's distribution, the
row is copied to one row per continuation, and one forward of the right-padded continuations
over the cache scores the rest. Same numbers as the padded path up to fp32 summation order; the
context's cost is paid once instead of once per choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import groupby

import torch

from engine.requests import ScoreResult
from models.kv_cache import KVCache

Forward = Callable[[torch.Tensor, torch.Tensor | None, KVCache | None], torch.Tensor]
"""(ids [B, S], key padding mask [B, S] or None, KV cache or None) -> logits [B, S, V]; with a
cache the ids are appended to it. A pipeline splits the forward over ranks."""
NewCache = Callable[[int, int], KVCache]
"""(rows, slots per row) -> an empty KV cache for the model `Forward` runs."""


@torch.inference_mode()
def score_batch(
    forward: Forward,
    items: list[tuple[list[int], list[int]]],
    *,
    device: torch.device,
    pad_id: int = 0,
    max_batch_tokens: int = 8192,
    new_cache: NewCache | None = None,
    top_logprobs: int = 0,
) -> list[ScoreResult]:
    """Score `(context_ids, continuation_ids)` pairs; every context must be non-empty.

    With `new_cache`, items sharing a context run it once (see the module docstring). A
    repeated item is scored once and its result copied. `top_logprobs` > 0 also reports the
    that many most likely tokens at every continuation position."""
    results: list[ScoreResult | None] = [None] * len(items)
    first_of: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    original = [first_of.setdefault((tuple(c), tuple(x)), i) for i, (c, x) in enumerate(items)]
    distinct = list(first_of.values())
    alone = distinct
    if new_cache is not None:
        alone = []
        by_context = sorted(distinct, key=lambda i: items[i][0])
        for _, group in groupby(by_context, key=lambda i: items[i][0]):
            members = list(group)
            if len(members) == 1:
                alone += members
                continue
            for i, result in _score_shared(
                forward, new_cache, items, members, device, pad_id, max_batch_tokens, top_logprobs
            ):
                results[i] = result
    # Longest first, so each batch pads little and the token budget holds.
    order = sorted(alone, key=lambda i: -(len(items[i][0]) + len(items[i][1])))
    start = 0
    while start < len(order):
        longest = len(items[order[start]][0]) + len(items[order[start]][1])
        size = max(1, max_batch_tokens // longest)
        batch = order[start : start + size]
        start += size
        ids_BS = torch.full((len(batch), longest), pad_id, dtype=torch.long, device=device)
        mask_BS = torch.zeros(len(batch), longest, dtype=torch.bool, device=device)
        for row, i in enumerate(batch):
            full = items[i][0] + items[i][1]
            ids_BS[row, : len(full)] = torch.tensor(full, device=device)
            mask_BS[row, : len(full)] = True
        logprobs_BSV = torch.log_softmax(forward(ids_BS, mask_BS, None).float(), -1)
        for row, i in enumerate(batch):
            context, continuation = items[i]
            first = len(context) - 1
            rows_CV = logprobs_BSV[row, first : first + len(continuation)]
            results[i] = _result(rows_CV, continuation, device, top_logprobs)
    for i, j in enumerate(original):
        if i != j:
            done = results[j]
            assert done is not None
            results[i] = replace(
                done,
                token_logprobs=list(done.token_logprobs),
                top_logprobs=[list(top) for top in done.top_logprobs],
            )
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def _result(
    logprobs_CV: torch.Tensor, continuation: list[int], device: torch.device, top_k: int = 0
) -> ScoreResult:
    """The score of a continuation from the log-softmax rows that predict its tokens."""
    target_C = torch.tensor(continuation, device=device)
    token_lp_C = logprobs_CV.gather(1, target_C[:, None])[:, 0]
    greedy = bool((logprobs_CV.argmax(-1) == target_C).all())
    token_lps = token_lp_C.tolist()
    top: list[list[tuple[int, float]]] = []
    if top_k > 0:
        values_CK, ids_CK = logprobs_CV.topk(min(top_k, logprobs_CV.shape[-1]), dim=-1)
        top = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(ids_CK.tolist(), values_CK.tolist(), strict=True)
        ]
    return ScoreResult(float(sum(token_lps)), greedy, token_lps, top)


def _score_shared(
    forward: Forward,
    new_cache: NewCache,
    items: list[tuple[list[int], list[int]]],
    members: list[int],
    device: torch.device,
    pad_id: int,
    max_batch_tokens: int,
    top_k: int = 0,
) -> list[tuple[int, ScoreResult]]:
    """Scores of items `members`, which share one context: the context runs once per chunk of
    continuations that fits the token budget."""
    context = items[members[0]][0]
    # Longest first, so each chunk's cache and padding stay tight.
    members = sorted(members, key=lambda i: -len(items[i][1]))
    out = []
    start = 0
    while start < len(members):
        slots = len(context) + len(items[members[start]][1])
        chunk = members[start : start + max(1, max_batch_tokens // slots)]
        start += len(chunk)
        cache = new_cache(len(chunk), slots)
        context_1S = torch.tensor([context], device=device)
        first_lp_V = torch.log_softmax(
            forward(context_1S, None, cache.rows(0, 1))[0, -1].float(), -1
        )
        _copy_first_row(cache, len(chunk))
        conts = [items[i][1] for i in chunk]
        longest = len(conts[0])
        ids_BC = torch.full((len(chunk), longest), pad_id, dtype=torch.long, device=device)
        mask_BC = torch.zeros(len(chunk), longest, dtype=torch.bool, device=device)
        for row, cont in enumerate(conts):
            ids_BC[row, : len(cont)] = torch.tensor(cont, device=device)
            mask_BC[row, : len(cont)] = True
        # The last continuation token predicts nothing we score: leave it out of the forward.
        logprobs_BCV = None
        if longest > 1:
            logits_BCV = forward(ids_BC[:, :-1], mask_BC[:, :-1], cache)
            logprobs_BCV = torch.log_softmax(logits_BCV.float(), -1)
        for row, (i, cont) in enumerate(zip(chunk, conts, strict=True)):
            rows_CV = first_lp_V[None]
            if logprobs_BCV is not None and len(cont) > 1:
                rows_CV = torch.cat([rows_CV, logprobs_BCV[row, : len(cont) - 1]])
            out.append((i, _result(rows_CV, cont, device, top_k)))
    return out


def _copy_first_row(cache: KVCache, rows: int) -> None:
    """Rows 1..rows-1 of `cache` become copies of row 0 (its keys, values, mask and length)."""
    used = int(cache.lengths_B[0])
    for store in (cache.k_BSKD, cache.v_BSKD):
        for buf in store.values():
            buf[1:rows, :used] = buf[:1, :used]
    cache.key_mask_BS[1:rows] = cache.key_mask_BS[:1]
    cache.lengths_B[1:rows] = cache.lengths_B[0]
