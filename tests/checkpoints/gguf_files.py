"""Small llama-architecture GGUF files written with the `gguf` package, for the GGUF tests.

Matrices take the ggml types in turn, so one file holds every type Meshline reads. Types the
package can quantize (Q8_0, Q4_0, Q4_1, BF16) are quantized from random values with
`gguf.quants.quantize`; the K-quants, which it only dequantizes, are random blocks whose f16
super-block scales are set to small finite values (every other byte of a K-quant block is a
valid code, so random bytes make valid blocks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 64
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
"""Every type the reader supports, in the order matrices take them."""
_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 210)}
_MIN_BYTES = {"Q4_K": (2, 4), "Q5_K": (2, 4)}


def _f16_bytes(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.uniform(-0.02, 0.02, size=count).astype(np.float16).view(np.uint8).reshape(count, 2)


def random_k_quant(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random `kind` blocks (uint8 [rows, row bytes]) with small finite f16 scales."""
    size = _BLOCK[kind]
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    lo, hi = _SCALE_BYTES[kind]
    raw[:, lo:hi] = _f16_bytes(rng, len(raw))
    if kind in _MIN_BYTES:
        lo, hi = _MIN_BYTES[kind]
        raw[:, lo:hi] = _f16_bytes(rng, len(raw))
    return raw.reshape(rows, -1)


def add_matrix(writer: GGUFWriter, name: str, kind: str, rows: int, cols: int, rng) -> None:
    """One [rows, cols] tensor of ggml type `kind` with random contents."""
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == "F32":
        writer.add_tensor(name, values)
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif kind in _BLOCK:
        raw = random_k_quant(rng, kind, rows, cols)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
    else:
        raw = quantize(values, GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a tiny byte-level BPE vocabulary of VOCAB entries."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
    while len(tokens) < VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
    types = [3, 3, 3] + [1] * (VOCAB - 3)
    return tokens, types, merges


def write_llama_gguf(path: Path, types: tuple[str, ...] = TYPES, seed: int = 0, **extra) -> Path:
    """A 2-layer llama GGUF (GQA, untied head) whose matrices cycle through `types`; `extra`
    metadata keys are added as strings/ints (to test refusals)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny-gguf")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(0)
    tokens, token_types, merges = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    kinds = iter(types * 8)
    kv = HIDDEN // HEADS * KV_HEADS
    add_matrix(writer, "token_embd.weight", next(kinds), VOCAB, HIDDEN, rng)
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        writer.add_tensor(
            f"{prefix}.attn_norm.weight", 1 + rng.standard_normal(HIDDEN).astype(np.float32) * 0.1
        )
        for name, rows, cols in (
            ("attn_q", HIDDEN, HIDDEN),
            ("attn_k", kv, HIDDEN),
            ("attn_v", kv, HIDDEN),
            ("attn_output", HIDDEN, HIDDEN),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ):
            add_matrix(writer, f"{prefix}.{name}.weight", next(kinds), rows, cols, rng)
        writer.add_tensor(
            f"{prefix}.ffn_norm.weight", 1 + rng.standard_normal(HIDDEN).astype(np.float32) * 0.1
        )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add_matrix(writer, "output.weight", next(kinds), VOCAB, HIDDEN, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "▁w",
              "or", "▁wor", "ld", "▁world", "▁t", "t", "a", "s", "▁a", "▁s"]  # fmt: skip
"""Pieces of a tiny SentencePiece vocabulary, best score first."""


def write_spm_gguf(path: Path, seed: int = 0) -> Path:
    """A 1-layer llama GGUF whose tokenizer is SentencePiece style (`tokenizer.ggml.model`
    llama): <unk>/<s>/</s>, 256 byte tokens, SPM_PIECES scored by rank, no merges."""
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    kv = HIDDEN // HEADS * KV_HEADS
    writer.add_tensor(
        "token_embd.weight", rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32)
    )
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN),
                             ("attn_v", kv, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                             ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN),
                             ("ffn_down", HIDDEN, FFN)):  # fmt: skip
        add_matrix(writer, f"blk.0.{name}.weight", "F32", rows, cols, rng)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
