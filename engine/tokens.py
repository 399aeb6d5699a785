"""The served model's vocabulary: special ids, and text <-> ids when a tokenizer is loaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models.tokenizer import Tokenizer


@dataclass
class TokenizerInfo:
    """Special ids and (optionally) the tokenizer of a served model."""

    vocab_size: int
    """Rows of the model's embedding: every valid token id is below it."""
    eos_id: int | None = None
    """End-of-sequence id (generation stops on it); None: never stops early."""
    bos_id: int | None = None
    """Beginning-of-sequence id (text prompts get it only where the tokenizer adds it)."""
    pad_id: int | None = None
    """Padding id, reported by GetModelInfo."""
    tokenizer: Tokenizer | None = None
    """Text <-> ids; None serves token ids only (text fields stay empty)."""

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer | None, vocab_size: int) -> TokenizerInfo:
        """Special ids from `tokenizer` (None: ids-only serving with no special tokens)."""
        if tokenizer is None:
            return cls(vocab_size)
        return cls(vocab_size, tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id, tokenizer)

    @property
    def decode(self) -> Callable[[Sequence[int]], str] | None:
        """Ids -> text without special tokens (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        tokenizer = self.tokenizer
        special = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode([i for i in ids if i not in special])

        return decode

    def require(self) -> Tokenizer:
        """The tokenizer, or ValueError saying how to give one."""
        if self.tokenizer is None:
            raise ValueError(
                "the server has no tokenizer: send token ids, or restart it with --tokenizer PATH "
                "(or a checkpoint that holds its tokenizer)"
            )
        return self.tokenizer

    @property
    def prefix_id(self) -> int | None:
        """The token an empty context is scored after: BOS, else EOS (lm-eval's prefix token)."""
        return self.bos_id if self.bos_id is not None else self.eos_id

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids of `text` as the tokenizer encodes it with its default settings
        (`AutoTokenizer.encode`: BOS/EOS only where the tokenizer itself adds them);
        `add_special_tokens=False` gives the text's ids alone (vLLM's request field)."""
        return self.require().encode(text, add_special_tokens=add_special_tokens)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Token strings of `ids` (sentencepiece pieces or HF tokens)."""
        return self.require().pieces(ids)

    def detokenize(self, ids: Sequence[int], skip_special: bool) -> str:
        """Text of `ids`, special tokens dropped when `skip_special`."""
        self.require()
        if skip_special:
            decode = self.decode
            assert decode is not None
            return decode(ids)
        return self.require().decode_keep_special(ids)
