"""Structured output: token masks from a grammar, one matcher per sequence (llguidance).

A request's `SamplingConfig.grammar` is an llguidance grammar (what `LLMatcher.grammar_from_*`
return: JSON schema, regex, Lark, choices). Every sequence of the request gets its own
`GrammarMatcher`; before each pick the engine asks it which tokens may come next (the others'
logits become -inf, so neither the arg-max nor a draw can take them) and tells it the token
taken. Once the grammar is complete only EOS is allowed, so the sequence ends with STOP.

llguidance reads the vocabulary from the fast tokenizer's `tokenizer.json`; building that
(~0.5 s for a 50k vocabulary) happens once per tokenizer and is cached. Why llguidance and not
xgrammar or outlines-core: docs/decisions.md.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.grammar_plan import accepts, byte_tokens, compact, walk
from engine.tokens import TokenizerInfo

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

NEG_INF = float("-inf")
_UNKNOWN = object()
_cache_lock = threading.Lock()
_tokenizers: dict[int, tuple[Any, LLTokenizer]] = {}
"""id(tokenizer) -> (the tokenizer, kept alive so the id stays its own; its LLTokenizer)."""


class GrammarError(ValueError):
    """A grammar that cannot be used with this tokenizer (bad schema, regex, or no vocabulary)."""


def grammar_tokenizer(tokens: TokenizerInfo) -> LLTokenizer:
    """The served vocabulary as llguidance sees it (built once per tokenizer)."""
    tokenizer = tokens.tokenizer
    if tokenizer is None:
        raise GrammarError("structured output needs the served model's tokenizer; it has none")
    with _cache_lock:
        hit = _tokenizers.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    source = getattr(tokenizer, "tokenizer_json", None)
    text = source() if callable(source) else None
    if text is None:
        raise GrammarError(
            "structured output needs a Hugging Face fast tokenizer (tokenizer.json); the served "
            "tokenizer is not one"
        )
    import llguidance

    built = llguidance.LLTokenizer(text, n_vocab=tokens.vocab_size, eos_token=tokens.eos_id)
    with _cache_lock:
        _tokenizers[id(tokenizer)] = (tokenizer, built)
    return built


def grammar_problem(grammar: str, tokens: TokenizerInfo | None) -> str | None:
    """Why `grammar` cannot constrain this model's output (None: it can); with `tokens` None,
    whether it is well-formed at all (no vocabulary needed)."""
    vocab = None
    if tokens is not None:
        try:
            vocab = grammar_tokenizer(tokens)
        except GrammarError as exc:
            return str(exc)
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, vocab)
    return messages[0] if is_error else None


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The grammar of JSON that validates against `schema`, written compactly (no free
    whitespace, which a weak model would otherwise pad the output with up to its token limit)."""
    from llguidance import LLMatcher

    if schema is False:
        raise GrammarError("the schema `false` accepts no JSON at all; give an object schema")
    source: dict[str, Any] = {} if schema is True else schema  # `true` accepts any JSON, as {}
    return LLMatcher.grammar_from_json_schema(source, overrides={"whitespace_flexible": False})


def regex_grammar(pattern: str) -> str:
    """The grammar of text that matches `pattern` whole (Rust `regex` syntax)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """The grammar of exactly one of `choices` (non-empty strings)."""
    from llguidance import LLMatcher

    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return LLMatcher.grammar_from_lark(f"start: {alternatives}")


def lark_grammar(text: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: `%json {schema}` embeds a schema)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(text)


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next, the ones taken, and a
    plan that completes the grammar from here (engine/grammar_plan.py)."""

    def __init__(self, grammar: str, tokens: TokenizerInfo) -> None:
        from llguidance import LLMatcher

        self._vocab = grammar_tokenizer(tokens)
        self._matcher = LLMatcher(self._vocab, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._eos = tokens.eos_id
        self._plan: list[int] | object | None = _UNKNOWN
        """Tokens that complete the grammar from this state; None: the walk found none (the
        sequence runs unguided); _UNKNOWN: not computed yet."""
        self._after: dict[int, list[int] | None] = {}
        """Plans already found for this state after a token (None: none fits any budget)."""

    def allowed(self, vocab: int) -> np.ndarray:
        """Bool [vocab]: the tokens the grammar allows next (ids past its vocabulary: never)."""
        bias = self._matcher.compute_logit_bias()  # one byte per token, 0: forbidden
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        allowed = np.zeros(vocab, dtype=bool)
        known = min(vocab, len(bias))
        allowed[:known] = np.frombuffer(bias, dtype=np.uint8, count=known) != 0
        return allowed

    def clone(self) -> GrammarMatcher:
        """An independent copy in the same state (a beam that forks keeps its own)."""
        other = object.__new__(GrammarMatcher)
        other._vocab = self._vocab
        other._matcher = self._matcher.deep_copy()
        other._eos = self._eos
        other._plan = self._plan
        other._after = dict(self._after)
        return other

    def advance(self, token: int) -> None:
        """Take `token` (one `allowed` said yes to)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} breaks the grammar: {self._matcher.get_error()}")
        self._plan = self._after.get(token, _UNKNOWN)
        self._after = {}

    def is_complete(self) -> bool:
        """Whether the text so far is a whole answer the grammar can only end (EOS next)."""
        return self._matcher.is_accepting() and self._matcher.is_stopped()

    def plan(self) -> list[int] | None:
        """Tokens that complete the grammar from this state (None: none was found)."""
        if self._plan is _UNKNOWN:
            self._plan = self._find_plan(self._matcher)
        return self._plan  # type: ignore[return-value]

    def fits(self, token: int, budget: int) -> bool:
        """Whether the state after `token` (one `allowed` said yes to) has a plan of at most
        budget - 1 tokens, `budget` counting this one (True where this state has no plan: the
        sequence runs unguided)."""
        plan = self.plan()
        if plan is None:
            return True
        if token not in self._after:
            self._after[token] = self._plan_after(token, plan)
        after = self._after[token]
        return after is not None and len(after) <= budget - 1

    def steer(self, token: int, budget: int) -> int:
        """The token to take, `budget` tokens (this one included) before the length limit:
        `token` (the model's pick, one `allowed` said yes to) when it `fits`, else the first
        token of this state's plan (EOS when the grammar is complete). Call `advance` next."""
        if self.fits(token, budget):
            return token
        plan = self.plan()
        assert plan is not None
        if not plan:  # complete: end here (a vocabulary without EOS cannot; take the pick)
            return token if self._eos is None else self._eos
        self._after[plan[0]] = plan[1:]
        return plan[0]

    def _plan_after(self, token: int, plan: list[int]) -> list[int] | None:
        """A plan for this state after `token`: the rest of this state's plan when the token
        starts it, this state's plan when it still completes (a letter inside a free string),
        else a fresh walk."""
        if plan and token == plan[0]:
            return plan[1:]
        if token == self._eos:
            return []
        probe = self._matcher.deep_copy()
        if not probe.consume_token(token):
            return None
        vocab = self._vocab
        text, planned = vocab.decode_bytes([token]), vocab.decode_bytes(plan)
        if plan and len(text) < len(planned) and planned.startswith(text):
            rest = vocab.tokenize_bytes(planned[len(text) :])
            if accepts(probe, rest):
                return rest
        if plan and accepts(probe, plan):
            return plan
        return self._find_plan(probe)

    def _find_plan(self, matcher: LLMatcher) -> list[int] | None:
        found = walk(matcher, byte_tokens(self._vocab))
        return None if found is None else compact(matcher, self._vocab, found)


def mask_rows(logits_PV: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """Logits with every token a row's matcher forbids at -inf (rows without one unchanged).

    The mask is built in numpy and applied with one torch op: llguidance's 32-token bit words
    unpacked by a few small torch ops measured ~80 ms a row on the shared 2-core box (each
    multi-threaded op waiting for a busy core), numpy's single-threaded build ~0.1 ms."""
    if all(m is None for m in matchers):
        return logits_PV
    vocab = logits_PV.shape[-1]
    forbidden_PV = np.zeros(logits_PV.shape, dtype=bool)
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            forbidden_PV[row] = ~matcher.allowed(vocab)
    return logits_PV.masked_fill(torch.from_numpy(forbidden_PV).to(logits_PV.device), NEG_INF)
