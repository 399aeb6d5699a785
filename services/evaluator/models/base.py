"""`LanguageModel`: what tasks need from a model, with lm-eval's tokenisation rules on top.

Implementations provide the primitives over token ids (tokenize with or without the
tokenizer's special tokens, the special tokens' ids and texts, score, generate, context length);
this class turns text requests into them the way lm-evaluation-harness 0.4's HF model (`HFLM`,
default `add_bos_token=None`) does:

- a text is encoded as the tokenizer's defaults say (`tokenizer.encode(text)`: BOS only where
  the tokenizer adds one), except that a text already starting with the prefix token's text
  (log-likelihood) or the BOS text (generation) gets no special tokens; `add_bos_token` True /
  False (lm-eval's model argument) puts BOS first / encodes the text alone instead;
- log-likelihood: trailing whitespace of a context moves to the front of its continuation; the
  continuation is what encoding context + continuation adds after the context's tokens; an empty
  context is the prefix token (BOS, else EOS) before the continuation's own ids, or the
  continuation's first token when that already is the prefix token (a tokenizer with neither BOS
  nor EOS fails only such requests: generation and non-empty contexts need no prefix);
- contexts too long for the model are cut from the left (log-likelihood: context +
  continuation fit the context length; generation: the prompt leaves room for
  `max_new_tokens`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialTokens:
    """The served tokenizer's special tokens that lm-eval's encoding rules look at."""

    bos_id: int | None
    """BOS id (None: the tokenizer has none)."""
    bos_text: str | None
    """BOS as text (`<s>`); a generation prompt starting with it gets no special tokens."""
    prefix_id: int | None
    """lm-eval's prefix token: BOS, else EOS; an empty context is scored after it (None: the
    tokenizer has neither, so only requests that need no prefix can run)."""
    prefix_text: str | None
    """The prefix token as text; a context starting with it gets no special tokens."""
    eos_id: int | None = None
    """EOS id: a reward task's responses end with it, as `meshline preprocess` writes pairs."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation (greedy unless a temperature is given)."""

    context: str
    """The prompt text."""
    until: tuple[str, ...]
    """Stop strings (the answer is cut before the first)."""
    max_new_tokens: int
    """Tokens generated at most."""
    temperature: float | None = None
    """None: greedy; else sample at this temperature (pass@k with several samples)."""
    seed: int = 0
    """Sampler seed (each sample of a prompt gets its own)."""


class LanguageModel(ABC):
    """A causal LM that can score continuations and generate greedily, or a reward model
    (`is_reward_model`) that scores whole sequences (`reward_ids`)."""

    name: str = ""
    """What is evaluated (endpoint or checkpoint path), for the results."""
    flag: str = ""
    """The command-line flag that named `name` (`--endpoint`, `--load`), for errors."""
    add_bos_token: bool | None = None
    """lm-eval's `add_bos_token`: None follows the tokenizer's own settings; True puts BOS
    before every text, False encodes texts without special tokens."""

    @property
    def fingerprint(self) -> str:
        """Identity of the model behind `name`; keys the response cache."""
        return self.name

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Longest token sequence the model takes."""

    @abstractmethod
    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; with `add_special_tokens` framed as the tokenizer's own
        settings say (transformers' default `encode`), else the text's ids alone."""

    @property
    @abstractmethod
    def special_tokens(self) -> SpecialTokens:
        """The tokenizer's BOS / prefix token, as ids and texts."""

    @abstractmethod
    def score_ids(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-prob, is_greedy) of each continuation after its context (ids)."""

    @abstractmethod
    def generate_ids(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[str]:
        """Generations for prompt ids, cut before the first stop string."""

    def close(self) -> None:  # noqa: B027 - most models hold nothing to release
        """Release connections or the engine."""

    @property
    def is_reward_model(self) -> bool | None:
        """Whether the model is a reward model (None: not known before asking it)."""
        return False

    def reward_ids(self, rows: list[list[int]]) -> list[float]:
        """One reward per row of ids; a causal LM has none (ValueError naming the model)."""
        raise ValueError(
            f"{self.flag} {self.name} is a causal LM, not a reward model (no scalar value head); "
            "reward tasks (rm_pairs) need a `meshline train --stage rm` checkpoint"
        )

    def reward(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The reward of each (prompt, response), encoded as `meshline preprocess` encodes a
        plain-text preference pair (no prompt template): the prompt with the tokenizer's own
        framing (BOS where it adds one), the response's ids alone, then EOS; the prompt is cut
        from the left when the whole is longer than the context length."""
        eos = self.special_tokens.eos_id
        if eos is None:
            raise ValueError(
                f"{self.flag} {self.name}: the tokenizer has no EOS token, which ends each "
                "response as `meshline preprocess` writes pairs"
            )
        prompts = sorted({p for p, _ in pairs})
        replies = sorted({r for _, r in pairs})
        prompt_ids = dict(zip(prompts, self.tokenize(prompts, True), strict=True))
        reply_ids = dict(zip(replies, self.tokenize(replies, False), strict=True))
        rows = []
        limit = self.context_length
        for prompt, reply in pairs:
            # Cut from the left (as lm-eval cuts contexts): the response's last token, whose
            # score is the reward, stays.
            rows.append([*prompt_ids[prompt], *reply_ids[reply], eos][-limit:])
        return self.reward_ids(rows)

    # -- text level, shared ---------------------------------------------------------------------

    def encode_texts(self, texts: list[str], plain_prefix: str | None) -> dict[str, list[int]]:
        """Ids of each distinct text under lm-eval's rule (module docstring); a text starting with
        `plain_prefix` (a special token's text) is encoded without special tokens."""
        unique = sorted(set(texts))
        plain = [t for t in unique if self.add_bos_token is False or _starts(t, plain_prefix)]
        framed = [t for t in unique if t not in set(plain)]
        ids = dict(zip(plain, self.tokenize(plain, False) if plain else [], strict=True))
        if self.add_bos_token:  # lm-eval's add_bos_token=True: BOS, then the text alone
            bos = self.special_tokens.bos_id
            if bos is None:
                raise ValueError("add_bos_token: the tokenizer has no BOS token; leave it unset")
            found = self.tokenize(framed, False) if framed else []
            ids.update(zip(framed, ([bos, *f] for f in found), strict=True))
        elif framed:
            ids.update(zip(framed, self.tokenize(framed, True), strict=True))
        return ids

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each (context, continuation) pair."""
        special = self.special_tokens
        contexts, continuations, empty = [], [], []
        for context, continuation in requests:
            empty.append(context == "")  # before moving spaces, as lm-eval tests it
            spaces = len(context) - len(context.rstrip())
            if spaces:
                continuation = context[-spaces:] + continuation
                context = context[:-spaces]
            contexts.append(context)
            continuations.append(continuation)
        wholes = [c + x for c, x in zip(contexts, continuations, strict=True)]
        pairs = [
            t for e, c, w in zip(empty, contexts, wholes, strict=True) if not e for t in (c, w)
        ]
        ids = self.encode_texts(pairs, special.prefix_text)
        alone = sorted({x for e, x in zip(empty, continuations, strict=True) if e})
        alone_ids = dict(zip(alone, self.tokenize(alone, False) if alone else [], strict=True))
        items = []
        limit = self.context_length
        for is_empty, context, continuation, whole in zip(
            empty, contexts, continuations, wholes, strict=True
        ):
            if not is_empty:
                ctx = ids[context]
                cont = ids[whole][len(ctx) :]
            else:
                cont = alone_ids[continuation]
                if special.prefix_id is None:
                    # lm-eval needs the prefix only here, so tasks without an empty context
                    # (generation, most multiple choice) run on such tokenizers
                    raise ValueError(
                        f"{self.flag} {self.name}: a log-likelihood request has an empty context, "
                        "which is scored after the tokenizer's BOS (else EOS) token, and the "
                        "tokenizer has neither; use a model whose tokenizer defines one"
                    )
                if cont and cont[0] == special.prefix_id:
                    ctx, cont = cont[:1], cont[1:]
                else:
                    ctx = [special.prefix_id]
            if not cont:
                raise ValueError(f"continuation {whole[len(context) :]!r} encodes to no tokens")
            cont = cont[-(limit - 1) :]
            items.append((ctx[-(limit - len(cont)) :], cont))
        return self.score_ids(items)

    def generate_until(self, requests: list[GenerationRequest]) -> list[str]:
        """Greedy answers to each request."""
        ids = self.encode_texts([r.context for r in requests], self.special_tokens.bos_text)
        prompts = []
        for request in requests:
            if request.max_new_tokens >= self.context_length:
                raise ValueError(
                    f"max_new_tokens {request.max_new_tokens} leaves no room for a prompt in the "
                    f"model's context length {self.context_length}; lower --max-new-tokens"
                )
            room = self.context_length - request.max_new_tokens
            prompts.append(ids[request.context][-room:])
        return self.generate_ids(prompts, requests)

    def rolling_loglikelihood(self, tokens: list[int], prefix_id: int) -> tuple[float, int]:
        """(summed log-prob, token count) of a whole document in disjoint windows.

        Each window predicts up to context_length - 1 tokens given the one token before it
        (`prefix_id` before the first), as lm-eval's rolling perplexity with context_len=1.
        """
        size = self.context_length - 1
        items = []
        for start in range(0, len(tokens), size):
            before = [tokens[start - 1]] if start else [prefix_id]
            items.append((before, tokens[start : start + size]))
        scores = self.score_ids(items) if items else []
        return sum(s[0] for s in scores), len(tokens)


def _starts(text: str, prefix: str | None) -> bool:
    """lm-eval's `has_bos_prefix`: the text already starts with the special token's text."""
    return bool(prefix) and text.startswith(prefix)  # type: ignore[arg-type]
