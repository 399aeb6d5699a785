"""GGUF metadata ↔ what the rest of Meshline reads: an HF config dict and HF tokenizer files.

Reading maps llama.cpp's `llama.*` keys (llama.cpp's `llama` architecture: Llama, Mistral,
SmolLM, TinyLlama...) to an HF LlamaConfig dict, which `models.hf_config.config_from_hf` turns
into a ModelConfig (one mapping of HF configs, not a second one). A `llama.*` key that would
change the math and that Meshline does not map is refused by name rather than ignored. The
tokenizer (`tokenizer.ggml.*`) becomes a `tokenizer.json` (built with the `tokenizers` library)
plus a `tokenizer_config.json` holding the special tokens, `add_bos_token` and the chat template:

- `gpt2` (byte-level BPE): the vocabulary and merges as stored; the pre-tokenizer llama.cpp uses
  for `tokenizer.ggml.pre` (PRE_TOKENIZERS); tokens marked control (type 3) are special added
  tokens, user-defined ones (type 4) plain added tokens.
- `llama` (SentencePiece BPE with byte fallback): the vocabulary, its merges (stored, or derived
  from the scores as SentencePiece ranks them), the `▁` space handling of Llama's tokenizer.json.

Writing does the reverse for a GGUF output (`gguf_writer.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
"""`llama.<key>` → HF LlamaConfig key, each copied as is."""
_CHECKED = ("rope.dimension_count", "attention.key_length", "attention.value_length")
_ROPE_SCALING = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length")
_NO_MATH = ("tensor_data_layout", "rope.scaling.finetuned")

CONTROL, USER_DEFINED = 3, 4
"""`tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`)."""

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")
"""`tokenizer.ggml.pre` values of byte-level vocabularies read (llama.cpp's split rules:
default/gpt2 the GPT-2 regex, smollm single digits then GPT-2, llama-bpe/llama3 Llama 3's)."""


def field_values(reader: Any) -> dict[str, Any]:
    """Every metadata key of a `gguf.GGUFReader` with its value (str, number, bool or list)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _int(meta: dict[str, Any], key: str) -> int:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"GGUF metadata {key} = {value!r} is not a count")
    return value


def hf_config_dict(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF LlamaConfig dict the metadata describes (ValueError naming an unmapped key)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported: Meshline reads llama.cpp's "
            "'llama' architecture (Llama, Mistral, SmolLM, TinyLlama)"
        )
    hf: dict[str, Any] = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    for key, value in meta.items():
        if not key.startswith("llama."):
            continue
        sub = key.removeprefix("llama.")
        if sub in LLAMA_KEYS:
            hf[LLAMA_KEYS[sub]] = value
        elif sub not in _CHECKED and sub not in _ROPE_SCALING and sub not in _NO_MATH:
            raise ValueError(
                f"GGUF metadata {key} = {str(value)[:60]!r} is not supported by Meshline's "
                "reader (it would change the model's math); nothing was converted"
            )
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in hf:
            gguf_key = next(k for k, v in LLAMA_KEYS.items() if v == key)
            raise ValueError(f"GGUF metadata lacks llama.{gguf_key}, which every llama file has")
        hf[key] = _int({key: hf[key]}, key)
    if isinstance(hf.get("num_key_value_heads"), list):
        raise ValueError("GGUF llama.attention.head_count_kv varies per layer; not supported")
    heads = hf["num_attention_heads"]
    head_dim = meta.get("llama.attention.key_length", hf["hidden_size"] // max(heads, 1))
    if meta.get("llama.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF llama.attention.value_length differs from key_length; not supported")
    rotary = meta.get("llama.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(
            f"GGUF llama.rope.dimension_count {rotary} is not the head size {head_dim}: partial "
            "rotary embeddings are not supported"
        )
    hf["head_dim"] = head_dim
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": meta["llama.rope.scaling.factor"]}
    elif scaling != "none":
        raise ValueError(
            f"GGUF llama.rope.scaling.type {scaling!r} is not supported (none, linear)"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF tensor rope_freqs.weight (Llama 3.1 per-frequency RoPE factors) is not supported"
        )
    if "vocab_size" not in hf and "tokenizer.ggml.tokens" in meta:
        hf["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    hf["tie_word_embeddings"] = "output.weight" not in tensor_names
    hf["hidden_act"] = "silu"
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            hf[f"{name}_token_id"] = meta[f"tokenizer.ggml.{key}"]
    return hf


# ---------------------------------------------------------------------------------------------
# Tokenizer: GGUF metadata -> tokenizer.json + tokenizer_config.json


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _merges(meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        merges = []
        for merge in meta["tokenizer.ggml.merges"]:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ValueError(f"GGUF tokenizer.ggml.merges entry {merge[:40]!r} is not 'a b'")
            merges.append((left, right))
        return merges
    # SentencePiece BPE: a piece is made from its two parts at the piece's score rank
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(meta["tokenizer.ggml.tokens"]):
        raise ValueError("GGUF tokenizer has neither merges nor one score per token")
    ranked = []
    for piece, score in zip(meta["tokenizer.ggml.tokens"], scores, strict=True):
        pairs = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        local = sorted(
            ((a, b) for a, b in pairs if a in vocab and b in vocab),
            key=lambda p: (vocab[p[0]], vocab[p[1]]),
        )
        ranked += [(score, len(a), len(b), a, b) for a, b in local]
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(a, b) for _, _, _, a, b in ranked]


def build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(a `tokenizers.Tokenizer`, the tokenizer_config.json dict) the metadata describes."""
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not isinstance(tokens, list) or not tokens:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r}: Meshline reads 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece) vocabularies with their tokenizer.ggml.tokens"
        )
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.token_type does not have one entry per token")
    if kind == "gpt2":
        tokenizer, special = _byte_level_tokenizer(meta, tokens, types)
        add_bos_default = False
    else:
        tokenizer, special = _sentencepiece_tokenizer(meta, tokens, types)
        add_bos_default = True
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    _bos_eos_template(tokenizer, config, tokens, meta)
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def _byte_level_tokenizer(
    meta: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[Any, list[str]]:
    """A 'gpt2' vocabulary: byte-level BPE with the pre-tokenizer its `tokenizer.ggml.pre` names;
    (tokenizer, its control tokens)."""
    from tokenizers import Tokenizer, decoders, models

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    spelled = [
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens
    ]
    vocab = {t: i for i, t in reversed(list(enumerate(spelled)))}
    model = models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=False)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    # control tokens llama.cpp spells outside the byte alphabet are mislabelled vocabulary
    special = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= alphabet]
    return tokenizer, special


def _byte_level_pre_tokenizer(pre_name: str) -> Any:
    """The split rules `tokenizer.ggml.pre` names, then the byte-level alphabet."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pre

    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_name in ("default", "gpt2"):
        return byte_level
    if pre_name == "smollm":
        return pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    if pre_name in ("llama-bpe", "llama3"):
        return pre.Sequence(
            [
                pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF tokenizer.ggml.pre {pre_name!r}: Meshline knows the split rules of "
        f"{list(PRE_TOKENIZERS)}"
    )


def _sentencepiece_tokenizer(
    meta: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[Any, list[str]]:
    """A 'llama' vocabulary: SentencePiece BPE with byte fallback and the ▁ space convention;
    (tokenizer, its control tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(
        vocab=vocab,
        merges=_merges(meta, vocab),
        unk_token=tokens[unk_id] if 0 <= unk_id < len(tokens) else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Replace(" ", "▁")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else [])
    )
    special = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    return tokenizer, special


def _bos_eos_template(
    tokenizer: Any, config: dict[str, Any], tokens: list[str], meta: dict
) -> None:
    """Bakes add_bos/add_eos into the tokenizer.json post-processor (the tokenizers library
    reads no tokenizer_config.json)."""
    from tokenizers import processors

    bos, eos = config.get("bos_token"), config.get("eos_token")
    add_bos = config["add_bos_token"] and bos is not None
    add_eos = config["add_eos_token"] and eos is not None
    if not (add_bos or add_eos):
        if meta.get("tokenizer.ggml.model") == "gpt2":
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = {}
    if add_bos:
        special[bos] = meta["tokenizer.ggml.bos_token_id"]
    if add_eos:
        special[eos] = meta["tokenizer.ggml.eos_token_id"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(special.items())
    )


def write_tokenizer(meta: dict[str, Any], directory: Path) -> list[Path]:
    """Writes the metadata's tokenizer as HF files into `directory`; returns their paths."""
    try:
        tokenizer, config = build_tokenizer(meta)
    except Exception as exc:  # the tokenizers library raises its own types on bad vocabularies
        if isinstance(exc, ValueError) and str(exc).startswith("GGUF"):
            raise
        raise ValueError(f"GGUF tokenizer metadata does not make a tokenizer ({exc})") from exc
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return [directory / "tokenizer.json", directory / "tokenizer_config.json"]
