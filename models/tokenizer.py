"""Tokenizers behind one small interface: SentencePiece models and HF tokenizer directories.

Special tokens, the same rule for every implementation and every stage (preprocess, serving,
scoring, evaluation):

- `encode(text, add_special_tokens=True)` is what the tokenizer itself gives with its default
  settings, as `AutoTokenizer.from_pretrained(dir).encode(text)` does: BOS / EOS exactly where the
  tokenizer's own post-processor (`tokenizer.json`) or `add_bos_token` / `add_eos_token`
  (tokenizer_config.json, for directories transformers loads) puts them. A bare SentencePiece
  `.model` carries no such flags: it follows the defaults of transformers' `LlamaTokenizer` built
  from it (BOS first when the model has a BOS piece, no EOS).
- `encode(text)` (add_special_tokens=False) returns the text's ids only. Special tokens written
  in the text (`<|im_start|>`, `<|begin_of_text|>`) become their ids in both modes for HF
  tokenizers, as transformers' default `split_special_tokens=False` does.
- `prefix_ids` / `suffix_ids` are what `add_special_tokens=True` puts before / after one text.
- `eod_id` (end of document, Megatron's name) is `eos_id`.
- `pad_id` is the tokenizer's own pad id when it has one, else `eod_id`: padded positions carry
  no loss, so any valid id works, and a real id keeps embedding lookups in range.
- `bos_id` / `eos_id` are None when the tokenizer defines no such token.

`train_sentencepiece` and `train_bpe_tokenizer` build tiny tokenizers locally (tests, benchmarks and
`make train` have no model hub).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

TOKENIZER_TYPES = ("SentencePiece", "PretrainedFromHF")


@runtime_checkable
class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer (see the module docstring for special ids)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eod_id: int
    pad_id: int

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; with `add_special_tokens` framed as the tokenizer's own defaults say."""
        ...

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` over many texts (faster: one call into the native tokenizer)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens dropped)."""
        ...

    def decode_keep_special(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens spelled out (`<s>`)."""
        ...

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Token strings of `ids` as the tokenizer's vocabulary spells them (`<s>`, `Ġthe`)."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-safe identity for manifests: type, path, vocab size, special ids, file checksum."""
        ...


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class SentencePieceTokenizer:
    """A `.model` file loaded with the `sentencepiece` library."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        import sentencepiece as spm

        self.path = Path(model_path)
        if not self.path.is_file():
            raise ValueError(
                f"--tokenizer-model {self.path}: no such file; pass a SentencePiece .model file "
                "(train one with models.tokenizer.train_sentencepiece)"
            )
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as exc:
            raise ValueError(
                f"--tokenizer-model {self.path}: not a readable SentencePiece model ({exc}); "
                "pass the .model file sentencepiece wrote"
            ) from exc
        self.vocab_size = int(self._sp.GetPieceSize())
        self.bos_id = self._valid(self._sp.bos_id())
        self.eos_id = self._valid(self._sp.eos_id())
        if self.eos_id is None:
            raise ValueError(
                f"--tokenizer-model {self.path}: the model has no EOS piece; train it with "
                "eos_id >= 0 so documents can be terminated"
            )
        self.eod_id = self.eos_id
        pad = self._valid(self._sp.pad_id())
        self.pad_id = self.eod_id if pad is None else pad
        # LlamaTokenizer's defaults for a bare model file: add_bos_token=True, add_eos_token=False.
        self.prefix_ids: tuple[int, ...] = () if self.bos_id is None else (self.bos_id,)
        self.suffix_ids: tuple[int, ...] = ()
        # Control and unknown pieces written in text (`<s>`, `</s>`, `<unk>`) are their ids, as
        # transformers' Llama tokenizer (which adds them as special tokens) reads them.
        self._specials = {
            str(self._sp.IdToPiece(i)): i
            for i in range(self.vocab_size)
            if self._sp.IsControl(i) or self._sp.IsUnknown(i)
        }
        self._split = re.compile(
            "("
            + "|".join(re.escape(p) for p in sorted(self._specials, key=len, reverse=True))
            + ")"
        )
        self._unk_len = len(self._sp.EncodeAsIds(self._sp.IdToPiece(self._sp.unk_id())))

    @staticmethod
    def _valid(token_id: int) -> int | None:
        return None if token_id < 0 else int(token_id)

    def _encode_with_specials(self, text: str) -> list[int]:
        """Ids of a text holding special pieces: text after one is encoded without the dummy
        prefix ("▁"), as transformers' LlamaTokenizer (legacy=False) does, by encoding it after
        the unknown piece's text and dropping that piece's ids."""
        ids: list[int] = []
        for index, part in enumerate(self._split.split(text)):
            if index % 2:
                ids.append(self._specials[part])
            elif part and index == 0:
                ids += self._sp.EncodeAsIds(part)
            elif part:
                unk = str(self._sp.IdToPiece(self._sp.unk_id()))
                ids += self._sp.EncodeAsIds(unk + part)[self._unk_len :]
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; BOS first with `add_special_tokens` when the model has one."""
        if self._specials and self._split.search(text):
            ids = self._encode_with_specials(text)
        else:
            ids = list(self._sp.EncodeAsIds(text))
        return [*self.prefix_ids, *ids, *self.suffix_ids] if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` over many texts in one native call."""
        encoded = [list(ids) for ids in self._sp.Encode(list(texts))]
        if self._specials:
            for i, text in enumerate(texts):
                if self._split.search(text):
                    encoded[i] = self._encode_with_specials(text)
        if not add_special_tokens:
            return encoded
        return [[*self.prefix_ids, *ids, *self.suffix_ids] for ids in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        return str(self._sp.DecodeIds([int(i) for i in ids]))

    def decode_keep_special(self, ids: Sequence[int]) -> str:
        """Text of `ids` with control pieces spelled out (DecodeIds drops them)."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._sp.IsControl(int(i)):
                out += [str(self._sp.DecodeIds(run)), str(self._sp.IdToPiece(int(i)))]
                run = []
            else:
                run.append(int(i))
        out.append(str(self._sp.DecodeIds(run)))
        return "".join(out)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Sentencepiece pieces of `ids` (`<s>`, `▁the`)."""
        return [str(self._sp.IdToPiece(int(i))) for i in ids]

    def describe(self) -> dict[str, Any]:
        """Identity for manifests."""
        return {
            "type": "SentencePiece",
            "path": str(self.path.resolve()),
            "sha256": _sha256(self.path),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
            "prefix_ids": list(self.prefix_ids),
            "suffix_ids": list(self.suffix_ids),
        }


def _special_token(directory: Path, name: str) -> str | None:
    """`name` (e.g. "eos_token") from tokenizer_config.json / special_tokens_map.json."""
    for file_name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / file_name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def _config_special_tokens(directory: Path) -> list[str]:
    """Every special token tokenizer_config.json names (bos/eos/unk/pad and the extra lists)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return []
    config = json.loads(path.read_text(encoding="utf-8"))
    found: list[str] = []
    values: list[Any] = [
        config.get(n) for n in ("bos_token", "eos_token", "unk_token", "pad_token")
    ]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        values += list(extra.values()) if isinstance(extra, dict) else list(extra or [])
    for value in values:
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value and value not in found:
            found.append(value)
    return found


class HFTokenizer:
    """A local HF tokenizer directory, encoding exactly as `AutoTokenizer.from_pretrained(dir)`.

    With `use_fast` and a `tokenizer.json`, the Rust `tokenizers` library loads it directly (what
    transformers' fast tokenizer wraps), which keeps worker start-up free of transformers/torch
    imports. It follows transformers 5's rules for such a directory: the post-processor of
    `tokenizer.json` decides BOS/EOS (transformers drops `add_bos_token`/`add_eos_token` of
    tokenizer_config.json when a tokenizer.json exists), and the special tokens named in
    tokenizer_config.json are matched in text even when tokenizer.json does not list them as added
    tokens. Otherwise transformers' `AutoTokenizer` loads it (`--tokenizer-not-use-fast` selects
    the slow Python tokenizer), and its own `encode` is used.
    """

    def __init__(self, name_or_path: str | os.PathLike[str], use_fast: bool = True) -> None:
        self.path = Path(name_or_path)
        if not self.path.is_dir():
            raise ValueError(
                f"--tokenizer-name-or-path {self.path}: no such directory; pass a local directory "
                "holding tokenizer.json or tokenizer_config.json (hub names cannot be downloaded here)"
            )
        self.use_fast = use_fast
        self._rust: Any = None
        self._tok: Any = None
        try:
            if use_fast and (self.path / "tokenizer.json").is_file():
                self._load_rust()
            else:
                self._load_transformers()
        except Exception as exc:  # the Rust library raises a bare Exception for a corrupt file
            raise ValueError(
                f"--tokenizer-name-or-path {self.path}: cannot load a tokenizer from it ({exc}); "
                "the directory needs tokenizer.json or a slow tokenizer's files"
            ) from exc
        if self.eos_id is None:
            raise ValueError(
                f"--tokenizer-name-or-path {self.path}: the tokenizer defines no eos_token; set "
                "eos_token in tokenizer_config.json so documents can be terminated"
            )
        self.eod_id = int(self.eos_id)
        self.pad_id = self.eod_id if self._pad_id is None else int(self._pad_id)
        self.prefix_ids, self.suffix_ids = self._framing()

    def _load_rust(self) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as RustTokenizer

        self._rust = RustTokenizer.from_file(str(self.path / "tokenizer.json"))
        added = {str(t.content) for t in self._rust.get_added_tokens_decoder().values()}
        missing = [t for t in _config_special_tokens(self.path) if t not in added]
        if missing:
            self._rust.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )
        self.vocab_size = int(self._rust.get_vocab_size(with_added_tokens=True))
        ids = {}
        for name in ("bos_token", "eos_token", "pad_token"):
            token = _special_token(self.path, name)
            ids[name] = None if token is None else self._rust.token_to_id(token)
        self.bos_id, self.eos_id, self._pad_id = (
            ids["bos_token"],
            ids["eos_token"],
            ids["pad_token"],
        )

    def _load_transformers(self) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(
            str(self.path), use_fast=self.use_fast, local_files_only=True, trust_remote_code=False
        )
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id
        self._pad_id = self._tok.pad_token_id

    def _framing(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids before, ids after) one text that the tokenizer's defaults add, read off a probe."""
        bare = self.encode("a")
        full = self.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return tuple(full[:start]), tuple(full[start + len(bare) :])
        raise ValueError(
            f"--tokenizer-name-or-path {self.path}: its post-processor changes the text's own "
            f"tokens ({bare} -> {full}); only processors that add tokens around a text are supported"
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; with `add_special_tokens` as the tokenizer's defaults frame it."""
        if self._rust is not None:
            return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` over many texts (the Rust backend batches them across threads)."""
        if not texts:
            return []
        if self._rust is not None:
            encoded = self._rust.encode_batch(list(texts), add_special_tokens=add_special_tokens)
            return [e.ids for e in encoded]
        found = self._tok(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return [list(ids) for ids in found]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens dropped."""
        values = [int(i) for i in ids]
        if self._rust is not None:
            return str(self._rust.decode(values, skip_special_tokens=True))
        return str(self._tok.decode(values, skip_special_tokens=True))

    def decode_keep_special(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens spelled out."""
        values = [int(i) for i in ids]
        if self._rust is not None:
            return str(self._rust.decode(values, skip_special_tokens=False))
        return str(self._tok.decode(values, skip_special_tokens=False))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids` (transformers' `convert_ids_to_tokens`)."""
        if self._rust is not None:
            return [str(self._rust.id_to_token(int(i))) for i in ids]
        return [str(t) for t in self._tok.convert_ids_to_tokens([int(i) for i in ids])]

    def tokenizer_json(self) -> str | None:
        """The fast tokenizer serialised as `tokenizer.json` (added tokens included), what
        grammar engines read the vocabulary from; None for a slow tokenizer."""
        backend = self._rust
        if backend is None and getattr(self._tok, "is_fast", False):
            backend = self._tok.backend_tokenizer
        return None if backend is None else str(backend.to_str())

    def describe(self) -> dict[str, Any]:
        """Identity for manifests (checksum of tokenizer.json, else tokenizer_config.json)."""
        checksum = None
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            candidate = self.path / name
            if candidate.is_file():
                checksum = {"file": name, "sha256": _sha256(candidate)}
                break
        return {
            "type": "PretrainedFromHF",
            "path": str(self.path.resolve()),
            "use_fast": self.use_fast,
            "backend": "tokenizers" if self._rust is not None else "transformers",
            "checksum": checksum,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
            "prefix_ids": list(self.prefix_ids),
            "suffix_ids": list(self.suffix_ids),
        }


def build_tokenizer(
    tokenizer_type: str, name_or_path: str | os.PathLike[str], *, use_fast: bool = True
) -> Tokenizer:
    """Load a tokenizer: "SentencePiece" takes a .model file, "PretrainedFromHF" a local directory."""
    if tokenizer_type == "SentencePiece":
        return SentencePieceTokenizer(name_or_path)
    if tokenizer_type == "PretrainedFromHF":
        return HFTokenizer(name_or_path, use_fast=use_fast)
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {list(TOKENIZER_TYPES)}"
    )


def train_sentencepiece(
    input_files: Sequence[str | os.PathLike[str]],
    model_prefix: str | os.PathLike[str],
    vocab_size: int,
    *,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    max_sentence_length: int = 16384,
    input_sentence_size: int = 200_000,
) -> Path:
    """Train a SentencePiece model on text files; returns the `.model` path.

    Ids 0..3 are `<unk>`, `<s>`, `</s>`, `<pad>` (LLaMA's layout plus a pad piece). As in LLaMA's
    model, text is not normalised (identity rule, whitespace kept, digits split) and byte fallback
    is on, so `decode(encode(text)) == text` for any string, code with its newlines and indentation
    included. One thread keeps the result deterministic.
    """
    import sentencepiece as spm

    files = [str(Path(f)) for f in input_files]
    missing = [f for f in files if not Path(f).is_file()]
    if not files or missing:
        raise ValueError(
            f"train_sentencepiece: input files missing or none given: {missing or files}"
        )
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.Train(
        input=",".join(files),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        max_sentence_length=max_sentence_length,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=False,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return Path(f"{prefix}.model")


def train_bpe_tokenizer(
    texts: Iterable[str],
    output_dir: str | os.PathLike[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = ("<unk>", "<s>", "</s>", "<pad>"),
) -> Path:
    """Train a byte-level BPE with `tokenizers` and save it as a HF fast-tokenizer directory.

    The directory loads with `AutoTokenizer.from_pretrained` (and `build_tokenizer(
    "PretrainedFromHF", ...)`); `<s>`, `</s>`, `<pad>` become bos / eos / pad.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(unk_token=special_tokens[0]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator(texts, trainer=trainer)
    unk, bos, eos, pad = special_tokens
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=rust, unk_token=unk, bos_token=bos, eos_token=eos, pad_token=pad
    )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("model_max_length", 1 << 20)
    config_path.write_text(json.dumps(config, indent=2))
    return out
