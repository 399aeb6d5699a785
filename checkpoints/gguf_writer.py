"""GGUF output: one `model.gguf` file llama.cpp loads (architecture `llama`), written with the
`gguf` package's `GGUFWriter`.

The writer plans every tensor (GGUF name, ggml type, shape, bytes) from the model config before
the first unit arrives, writes the header, metadata and tensor table, then streams each tensor's
bytes as its unit comes, so memory holds one unit. Matrices (and the token embedding) take the
requested type (`--gguf-type`, default from `--dtype`: F32/F16/BF16; Q8_0 and Q4_0 quantized
with llama.cpp's reference rounding, `gguf_quants.quantize`); a matrix whose rows do not fill
whole 32-value blocks is written F16 (llama.cpp's converter does the same); norms stay F32 as
llama.cpp expects. Q and K rows are permuted into llama.cpp's rotary order (`permute`).

Metadata: llama.cpp's `llama.*` hyper-parameters, `general.file_type`, and the tokenizer of the
source's `tokenizer.json` (a byte-level BPE: tokens, merges, token types, special ids,
`add_bos_token`, the chat template from tokenizer_config.json) — llama.cpp refuses a file
without a vocabulary, so a source without a byte-level BPE `tokenizer.json` is refused before
any weight is read (`check_config` / `tokenizer_metadata`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoints.gguf_format import LAYER_NAMES, TOP_NAMES, permute
from checkpoints.gguf_metadata import CONTROL, USER_DEFINED
from checkpoints.gguf_quants import (
    BF16,
    BLOCK_BYTES,
    BLOCK_ELEMENTS,
    F16,
    F32,
    Q4_0,
    Q8_0,
    WRITE_TYPES,
    quantize,
    require_gguf,
)
from checkpoints.units import Tensors, Unit, expected_shapes, unit_of, units
from models.config import ModelConfig
from models.hf_adapters import to_hf

FILE = "model.gguf"
NORMAL = 1
"""`tokenizer.ggml.token_type` of an ordinary vocabulary entry."""
_FILE_TYPE = {F32: 0, F16: 1, Q4_0: 2, Q8_0: 7, BF16: 32}
"""ggml type of the matrices → `general.file_type` (llama.cpp `llama_ftype`)."""
_DTYPE_TYPE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
_HF_TO_GGUF = {hf: gguf for gguf, (_, hf) in TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of an HF Llama tensor name."""
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    short = {hf: g for g, hf in LAYER_NAMES.items()}[module]
    return f"blk.{layer}.{short}.{kind}"


def check_config(config: ModelConfig) -> None:
    """Refuses (ValueError naming the setting) a model llama.cpp's llama architecture cannot hold."""
    problems = []
    if config.family not in ("llama", "mistral"):
        problems.append(f"family {config.family!r} (llama or mistral)")
    for name in ("attention_bias", "qkv_bias", "mlp_bias", "qk_norm", "embedding_layernorm"):
        if getattr(config, name):
            problems.append(f"{name}=True")
    if config.moe is not None:
        problems.append("MoE layers")
    if config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window}")
    if config.norm_type != "rmsnorm" or config.position_embedding != "rope":
        problems.append(f"{config.norm_type}/{config.position_embedding} (rmsnorm/rope)")
    if config.activation != "swiglu":
        problems.append(f"activation {config.activation!r} (swiglu)")
    if config.rope_scaling is not None and config.rope_scaling.get("type") != "linear":
        problems.append(f"rope_scaling {config.rope_scaling!r} (none or linear)")
    if problems:
        raise ValueError(
            "--save-format gguf writes llama.cpp's 'llama' architecture, which cannot hold this "
            f"model: {'; '.join(problems)}"
        )


def _tokenizer_files(files: list[Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    by_name = {p.name: p for p in files}
    if "tokenizer.json" not in by_name:
        raise ValueError(
            "--save-format gguf needs the source's tokenizer (a byte-level BPE tokenizer.json): "
            "llama.cpp loads no model without its vocabulary"
        )
    data = json.loads(by_name["tokenizer.json"].read_text())
    config = {}
    if "tokenizer_config.json" in by_name:
        config = json.loads(by_name["tokenizer_config.json"].read_text())
    return data, config


def _pre_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level tokenizer.json pre-tokenizer."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    raise ValueError(
        f"--save-format gguf: the tokenizer's pre-tokenizer {kinds} has no llama.cpp "
        "equivalent Meshline writes (ByteLevel: gpt2; Digits + ByteLevel: smollm)"
    )


def _token_text(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_metadata(files: list[Path], vocab_size: int) -> dict[str, Any]:
    """`tokenizer.*` keys for the source's byte-level BPE tokenizer (ValueError otherwise)."""
    data, config = _tokenizer_files(files)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(
            "--save-format gguf writes byte-level BPE tokenizers (GPT-2 style); this "
            f"tokenizer.json holds a {model.get('type')} model"
        )
    pre = _pre_name(data.get("pre_tokenizer"))
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    kinds: dict[int, int] = {}
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    if max(vocab.values(), default=-1) >= vocab_size:
        raise ValueError(
            f"--save-format gguf: the tokenizer has ids up to {max(vocab.values())} but the "
            f"model's vocabulary is {vocab_size}"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [USER_DEFINED] * vocab_size
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = kinds.get(index, NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False)),
    }
    index = {t: i for i, t in enumerate(tokens)}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token = _token_text(config, f"{name}_token")
        if token is not None and token in index:
            meta[f"tokenizer.ggml.{key}_token_id"] = index[token]
    if isinstance(config.get("chat_template"), str):
        meta["tokenizer.chat_template"] = config["chat_template"]
    return meta


class GGUFSink:
    """Writes `model.gguf` into `directory` (a temporary one the job renames when done)."""

    def __init__(
        self, directory: Path, source: Any, dtype: torch.dtype, gguf_type: str | None
    ) -> None:
        require_gguf()
        from gguf import GGMLQuantizationType, GGUFWriter

        config: ModelConfig = source.config
        check_config(config)
        self.config = config
        if gguf_type is None:
            self.matrix_type = _DTYPE_TYPE[dtype]
        elif gguf_type in WRITE_TYPES:
            self.matrix_type = WRITE_TYPES[gguf_type]
        else:
            raise ValueError(f"--gguf-type {gguf_type!r}: expected one of {list(WRITE_TYPES)}")
        tokenizer = tokenizer_metadata(source.tokenizer_files, config.vocab_size)
        self.path = directory / FILE
        writer = GGUFWriter(self.path, "llama")
        self._writer = writer
        self._add_metadata(tokenizer)
        self._plan: dict[Unit, list[tuple[str, str, int]]] = {}
        shapes = expected_shapes(config)
        for unit in units(config):
            meta = {
                n: torch.empty(s, device="meta")
                for n, s in shapes.items()
                if unit_of(n) == unit and not (n == "lm_head.weight" and config.tie_word_embeddings)
            }
            planned = []
            for hf_name, tensor in to_hf(meta, config).items():
                shape = tuple(tensor.shape)
                type_id = self._type_of(shape)
                nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (
                    shape[-1] // BLOCK_ELEMENTS[type_id] * BLOCK_BYTES[type_id]
                )
                name = gguf_name(hf_name)
                writer.add_tensor_info(
                    name,
                    (*shape[:-1], nbytes // max(1, int(np.prod(shape[:-1], dtype=np.int64)))),
                    np.dtype(np.uint8),
                    nbytes,
                    raw_dtype=GGMLQuantizationType(type_id),
                )
                planned.append((hf_name, name, type_id))
            self._plan[unit] = planned
        writer.write_header_to_file(self.path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

    def _type_of(self, shape: tuple[int, ...]) -> int:
        if len(shape) == 1:
            return F32
        if BLOCK_ELEMENTS[self.matrix_type] > 1 and shape[-1] % BLOCK_ELEMENTS[self.matrix_type]:
            return F16
        return self.matrix_type

    def _add_metadata(self, tokenizer: dict[str, Any]) -> None:
        c, w = self.config, self._writer
        registry = (c.extra or {}).get("registry_name")
        w.add_name(str(registry or "meshline-model"))
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_layers)
        w.add_feed_forward_length(c.ffn_hidden_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.kv_heads)
        w.add_rope_freq_base(float(c.rope_theta))
        w.add_layer_norm_rms_eps(float(c.norm_eps))
        w.add_rope_dimension_count(c.head_dim)
        w.add_vocab_size(c.vocab_size)
        if c.head_dim * c.num_attention_heads != c.hidden_size:
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        if c.rope_scaling is not None:  # linear (check_config)
            from gguf import RopeScalingType

            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(c.rope_scaling["factor"]))
        w.add_file_type(_FILE_TYPE[self.matrix_type])
        w.add_quantization_version(2)
        for key, value in tokenizer.items():
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            else:
                w.add_array(key, value)

    def write_unit(self, unit: Unit, tensors: Tensors) -> None:
        """Quantizes (or casts) and appends the unit's tensors in the planned order."""
        hf = to_hf(tensors, self.config)
        for hf_name, name, type_id in self._plan[unit]:
            tensor = hf[hf_name]
            if ".attn_q." in name:
                tensor = permute(tensor, self.config.num_attention_heads)
            elif ".attn_k." in name:
                tensor = permute(tensor, self.config.kv_heads)
            raw = quantize(tensor, type_id)
            self._writer.write_tensor_data(np.ascontiguousarray(raw))

    def abort(self) -> None:
        """Closes the file (incomplete; the caller removes the directory)."""
        self._writer.close()

    def finish(self) -> list[str]:
        """Closes the file; returns its name."""
        self._writer.close()
        return [FILE]
