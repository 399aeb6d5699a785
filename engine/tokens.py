"""The served model's vocabulary: special ids, and text <-> ids when a tokenizer is loaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from models.tokenizer import Tokenizer


@dataclass
class TokenizerInfo:
    """Special ids and (optionally) the tokenizer of a served model."""

    vocab_size: int
    """Rows of the model's embedding: every valid token id is below it."""
    eos_id: int | None = None
    """End-of-sequence id (generation stops on it); None: never stops early."""
    bos_id: int | None = None
    """Beginning-of-sequence id, prepended to text prompts and to empty score contexts."""
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

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids of `text`: BOS (when the tokenizer has one) then the text's ids."""
        ids = self.require().encode(text)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Token strings of `ids` (sentencepiece pieces or HF tokens)."""
        inner: Any = self.require()
        sp = getattr(inner, "_sp", None)
        if sp is not None:
            return [str(sp.IdToPiece(int(i))) for i in ids]
        hf = getattr(inner, "_tok", None)
        if hf is not None:
            return [str(t) for t in hf.convert_ids_to_tokens([int(i) for i in ids])]
        return [inner.decode([int(i)]) for i in ids]

    def detokenize(self, ids: Sequence[int], skip_special: bool) -> str:
        """Text of `ids`, special tokens dropped when `skip_special`."""
        self.require()
        if skip_special:
            decode = self.decode
            assert decode is not None
            return decode(ids)
        return self._decode_keep_special(ids)

    def _decode_keep_special(self, ids: Sequence[int]) -> str:
        tokenizer: Any = self.require()
        hf = getattr(tokenizer, "_tok", None)
        if hf is not None:
            return str(hf.decode([int(i) for i in ids], skip_special_tokens=False))
        sp = getattr(tokenizer, "_sp", None)
        if sp is not None:
            # sentencepiece drops control pieces in DecodeIds; spell them out between text runs.
            out: list[str] = []
            run: list[int] = []
            for i in ids:
                if sp.IsControl(int(i)):
                    out.append(str(sp.DecodeIds(run)))
                    out.append(str(sp.IdToPiece(int(i))))
                    run = []
                else:
                    run.append(int(i))
            out.append(str(sp.DecodeIds(run)))
            return "".join(out)
        return str(tokenizer.decode(ids))
