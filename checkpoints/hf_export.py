"""The files beside an HF checkpoint's weights that `AutoTokenizer` and `generate` need.

An HF output must load unchanged: `AutoTokenizer.from_pretrained(out)` and
`AutoModelForCausalLM.from_pretrained(out).generate(...)` stopping at EOS. `hf_side_files` takes
the tokenizer files a conversion carries over (from an HF source, or the `tokenizer/` directory
of a native or Megatron checkpoint, where a SentencePiece model may have any name) and returns
what to write:

- a SentencePiece model under the name HF expects, `tokenizer.model`;
- `tokenizer_config.json` when the source had none: the special tokens read from the
  tokenizer itself, `add_bos_token` (SentencePiece Llama-style: true; byte-level BPE: false) and
  the tokenizer class (`LlamaTokenizer` for SentencePiece, `PreTrainedTokenizerFast` for a
  `tokenizer.json`); a source's own tokenizer_config.json (chat template included) is kept as is;
- `generation_config.json` when the source had none, with bos/eos/pad ids;
- the bos/eos/pad ids for config.json: the model config's own (kept from an HF source through
  native and Megatron), else the tokenizer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL = ("bos", "eos", "pad", "unk")


@dataclass
class SideFiles:
    """What an HF output writes beside its weights."""

    copies: dict[str, Path] = field(default_factory=dict)
    """Output file name → source file to copy."""
    writes: dict[str, str] = field(default_factory=dict)
    """Output file name → text to write."""
    token_ids: dict[str, int] = field(default_factory=dict)
    """bos_token_id / eos_token_id / pad_token_id for config.json (those known)."""


def _sentencepiece_specials(path: Path) -> dict[str, tuple[str, int]]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.Load(str(path))
    out = {}
    for name in SPECIAL:
        token_id = getattr(sp, f"{name}_id")()
        if 0 <= token_id < sp.get_piece_size():
            out[name] = (sp.id_to_piece(token_id), token_id)
    return out


def _fast_specials(path: Path) -> dict[str, tuple[str, int]]:
    """Special tokens of a tokenizer.json by the conventional names it defines."""
    data = json.loads(path.read_text())
    added = {t["content"]: t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    guesses = {
        "bos": ("<s>", "<|begin_of_text|>", "<|endoftext|>"),
        "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"),
        "pad": ("<pad>", "<|pad|>", "<|endoftext|>"),
        "unk": ("<unk>",),
    }
    out = {}
    for name, candidates in guesses.items():
        for token in candidates:
            if token in added:
                out[name] = (token, added[token])
                break
    return out


def hf_side_files(
    tokenizer: list[Path], model_tokens: dict[str, int], max_length: int
) -> SideFiles:
    """Plan the tokenizer/generation files and token ids (see the module docstring)."""
    side = SideFiles()
    names = {p.name: p for p in tokenizer}
    specials: dict[str, tuple[str, int]] = {}
    tokenizer_class = None
    add_bos = False
    sp_models = [p for p in tokenizer if p.suffix == ".model"]
    if "tokenizer.json" in names:
        specials = _fast_specials(names["tokenizer.json"])
        tokenizer_class = "PreTrainedTokenizerFast"
    elif sp_models:
        chosen = names.get("tokenizer.model", sp_models[0])
        side.copies["tokenizer.model"] = chosen
        specials = _sentencepiece_specials(chosen)
        tokenizer_class, add_bos = "LlamaTokenizer", True
    for path in tokenizer:
        if path.suffix != ".model" or "tokenizer.json" in names:
            side.copies.setdefault(path.name, path)
    ids = {f"{n}_token_id": specials[n][1] for n in ("bos", "eos", "pad") if n in specials}
    ids.update(model_tokens)
    side.token_ids = ids
    if tokenizer_class is not None and "tokenizer_config.json" not in names:
        config: dict[str, Any] = {
            "tokenizer_class": tokenizer_class,
            "add_bos_token": add_bos,
            "add_eos_token": False,
            "model_max_length": max_length,
        }
        config.update({f"{n}_token": token for n, (token, _) in specials.items()})
        side.writes["tokenizer_config.json"] = json.dumps(config, indent=2, sort_keys=True)
    if "generation_config.json" not in names and ids:
        generation = {"_from_model_config": True, **ids}
        side.writes["generation_config.json"] = json.dumps(generation, indent=2, sort_keys=True)
    return side
