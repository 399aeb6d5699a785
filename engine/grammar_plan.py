"""Completion plans: a short token sequence that takes a grammar from its state to accepting.

Structured output must end as text the grammar accepts even when `max_new_tokens` runs out (an
unbounded string in a JSON schema would otherwise be cut mid-way). Each constrained sequence
keeps a plan: tokens that, consumed from its current state, leave the matcher accepting. The
engine lets the model's token through only when the state after it has a plan that still fits
the budget; else it takes the plan's first token. So the invariant "a plan that fits exists"
holds at every step and the output always completes (engine/grammar.py, `GrammarMatcher.steer`).

The matcher is opaque (llguidance exposes no distances), so a plan is found by walking the
matcher one byte at a time: forced bytes first, then closing bytes (`"`, `}`, `]`, `,`), then,
inside a lexeme with a pattern or a minimum, the byte that reaches a state whose set of allowed
bytes was not seen yet on this walk (progress; plain "first byte allowed" loops forever on
`[a-z0-9.]+@...`). A plan is short, not always the shortest; it is sound by construction: every
byte was accepted by a copy of the real matcher and the walk ends only when it accepts. The
byte plan is then re-tokenized with the model's vocabulary (fewer tokens), kept only if a copy
of the matcher accepts that tokenization too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

MAX_PLAN_BYTES = 512
"""A walk that has not reached an accepting state after this many bytes gives up (no plan)."""
CLOSERS = b'"}],'
"""Bytes that end a string, object, array or item: tried first, they shorten the plan most."""
ORDER = CLOSERS + b"0:.-@_/+ nft[{1" + bytes(range(0x30, 0x3A)) + bytes(range(0x61, 0x7B))
"""The bytes a walk tries, in order: closers, then short values and separators, then others."""
EXTRA = bytes(b for b in range(0x20, 0x7F) if b not in ORDER)
"""Printable ASCII bytes tried only when no byte of ORDER is allowed (a pattern's `[A-Z]`)."""
UTF8_TAIL = bytes(range(0x80, 0xC0))
"""Continuation bytes: after a token that ends inside a multi-byte character (byte-level
vocabularies split `é` or an emoji across tokens) only these may come next."""

_lock = threading.Lock()
_tables: dict[int, tuple[LLTokenizer, dict[int, int]]] = {}


def byte_tokens(vocab: LLTokenizer) -> dict[int, int]:
    """Byte -> the id of the token made of that byte alone (built once per vocabulary)."""
    with _lock:
        hit = _tables.get(id(vocab))
        if hit is not None and hit[0] is vocab:
            return hit[1]
    table = {}
    for b in [*range(0x20, 0x7F), *UTF8_TAIL]:
        ids = vocab.tokenize_bytes(bytes([b]))
        if len(ids) == 1:
            table[b] = ids[0]
    with _lock:
        _tables[id(vocab)] = (vocab, table)
    return table


def accepts(matcher: LLMatcher, tokens: list[int]) -> bool:
    """Whether `tokens`, consumed from the matcher's state, leave it accepting (state kept)."""
    probe = matcher.deep_copy()
    return probe.try_consume_tokens(tokens) == len(tokens) and probe.is_accepting()


def compact(matcher: LLMatcher, vocab: LLTokenizer, plan: list[int]) -> list[int]:
    """`plan` re-tokenized with the vocabulary's merges when the matcher accepts that too (it
    is fewer tokens, so the steering starts later); else `plan` unchanged."""
    if len(plan) < 2:
        return plan
    merged = vocab.tokenize_bytes(vocab.decode_bytes(plan))
    if len(merged) < len(plan) and accepts(matcher, merged):
        return merged
    return plan


def _allowed(probe: LLMatcher, table: dict[int, int], candidates: bytes) -> frozenset[int]:
    return frozenset(b for b in candidates if b in table and probe.validate_tokens([table[b]]))


def walk(matcher: LLMatcher, table: dict[int, int]) -> list[int] | None:
    """Single-byte tokens that take `matcher` (left unchanged) to an accepting state, or None
    when the walk finds none within MAX_PLAN_BYTES."""
    probe = matcher.deep_copy()
    plan: list[int] = []
    seen: set[frozenset[int]] = set()
    while not probe.is_accepting():
        if len(plan) > MAX_PLAN_BYTES or probe.is_error():
            return None
        forced = probe.compute_ff_tokens()
        if forced:
            taken = probe.try_consume_tokens(forced)
            if taken:
                plan += forced[:taken]
                continue
        step = next(
            (table[b] for b in CLOSERS if b in table and probe.validate_tokens([table[b]])), None
        )
        if step is None:
            step = _progress(probe, table, seen)
        if step is None or not probe.consume_token(step):
            return None
        plan.append(step)
    return plan


def _progress(probe: LLMatcher, table: dict[int, int], seen: set[frozenset[int]]) -> int | None:
    """Inside a lexeme no closer may end: the first allowed byte whose next state allows a set
    of bytes not seen yet on this walk, or the first allowed byte when none does."""
    here = _allowed(probe, table, ORDER) or _allowed(probe, table, EXTRA)
    if not here:  # inside a multi-byte character: any continuation byte finishes it as well
        tail = _allowed(probe, table, UTF8_TAIL)
        return table[min(tail)] if tail else None
    seen.add(here)
    order = [b for b in ORDER + EXTRA if b in here]
    for b in order:
        probe.consume_token(table[b])
        after = _allowed(probe, table, ORDER) or _allowed(probe, table, EXTRA)
        done = probe.is_accepting()
        probe.rollback(1)
        if done or after not in seen:
            seen.add(after)  # a forced byte may lead back here: that is not progress again
            return table[b]
    return table[order[0]]
