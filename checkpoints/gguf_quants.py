"""GGML tensor types: block layouts, dequantization to float32, and the quantizers GGUF output uses.

Each quantized type stores a row as blocks of `BLOCK_ELEMENTS` values in `BLOCK_BYTES` bytes
(ggml-common.h, `block_q8_0` and friends); a tensor's raw data is a uint8 array of whole blocks.
Dequantizing follows the C reference (`dequantize_row_*` in ggml-quants.c) step by step in
float32, products in the same order, so the result equals llama.cpp's and the `gguf` package's
(`gguf.quants.dequantize`, the reference the tests compare against) bit for bit:

- Q8_0: f16 scale d, 32 int8 q: x = d*q.
- Q4_0: f16 d, 16 bytes of nibbles (low nibbles are values 0-15, high 16-31): x = d*(q-8).
- Q4_1: f16 d, f16 m, nibbles as Q4_0: x = d*q + m.
- Q4_K: super-block of 256 = 8 sub-blocks of 32: f16 d, f16 dmin, 12 bytes of packed 6-bit
  (scale, min) pairs, 128 bytes of nibbles (each 32 bytes: a sub-block's low nibbles, then the
  next one's high nibbles): x = (d*scale)*q - (dmin*min).
- Q5_K: as Q4_K plus 32 bytes of fifth bits (bit 2j / 2j+1 of byte l: element l of sub-block
  2j / 2j+1), before the nibbles.
- Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 sub-block scales (of
  16 elements each), f16 d last: x = d*scale*(q-32).
"""

from __future__ import annotations

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
"""The ggml type ids (`enum ggml_type` in ggml.h) Meshline reads."""

NAMES = {
    F32: "F32",
    F16: "F16",
    BF16: "BF16",
    Q8_0: "Q8_0",
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}
"""Supported ggml types by id, as llama.cpp spells them."""

BLOCK_ELEMENTS = {F32: 1, F16: 1, BF16: 1, Q8_0: 32, Q4_0: 32, Q4_1: 32, Q4_K: 256, Q5_K: 256,
                  Q6_K: 256}  # fmt: skip
"""Values per block."""
BLOCK_BYTES = {F32: 4, F16: 2, BF16: 2, Q8_0: 34, Q4_0: 18, Q4_1: 20, Q4_K: 144, Q5_K: 176,
               Q6_K: 210}  # fmt: skip
"""Bytes per block."""

WRITE_TYPES = {"F32": F32, "F16": F16, "BF16": BF16, "Q8_0": Q8_0, "Q4_0": Q4_0}
"""Types the GGUF writer quantizes to (`--gguf-type`; checkpoints/registry.py GGUF_TYPES)."""


def require_gguf() -> None:
    """Raises ValueError naming the package when `gguf` (llama.cpp's Python reader/writer, used
    to parse and write the container) is not installed."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "GGUF files need the `gguf` package (llama.cpp's gguf-py): pip install 'gguf>=0.10'"
        ) from exc


def type_name(type_id: int) -> str:
    """llama.cpp's name of a ggml type id (the gguf package's enum for unsupported ones)."""
    if type_id in NAMES:
        return NAMES[type_id]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"


def supported_list() -> str:
    """The supported types, for messages."""
    return ", ".join(NAMES.values())


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 values stored in the last dim (2 bytes each) of a uint8 tensor, as f32."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 k] bytes -> [..., 32 k] values: per 16-byte group, low nibbles then high ones."""
    low, high = qs & 0x0F, qs >> 4
    return torch.stack([low, high], dim=-2).reshape(*qs.shape[:-1], -1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit (scale, min) pairs of Q4_K/Q5_K packed in 12 bytes (ggml `get_scale_min_k4`)."""
    s = scales.to(torch.int32)
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], 1).float(), torch.cat([low_m, high_m], 1).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return d * q


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).to(torch.float32) - 8
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).to(torch.float32)
    return d * q + m


def _k_quant_4_5(b: torch.Tensor, fifth: bool) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * m).reshape(n, 8, 1)
    qs = b[:, 48:] if fifth else b[:, 16:]
    # 4 chunks of 32 bytes; chunk j holds sub-block 2j in low nibbles and 2j+1 in high ones
    chunks = qs.reshape(n, 4, 32)
    q = torch.stack([chunks & 0x0F, chunks >> 4], 2).reshape(n, 8, 32).to(torch.int32)
    if fifth:
        qh = b[:, 16:48].to(torch.int32)  # [n, 32]: bit s of byte l is element l of sub-block s
        bits = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)) & 1
        q = q + bits * 16
    return (scale * q.to(torch.float32) - offset).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].to(torch.int32).reshape(n, 2, 64)
    qh = b[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32).reshape(n, 16, 1)
    d = _f16(b[:, 208:210]).reshape(n, 1, 1)
    # per 128-element half: 4 quarters of 32; quarter k takes low (k<2) or high nibbles of
    # ql[32*(k%2):...] and bits 2k..2k+1 of qh
    low = torch.stack(
        [ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2
    )
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16).to(torch.float32)
    return (d * sc * q).reshape(n, 256)


_BLOCK_DEQUANT = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q6_K: _q6_k,
                  Q4_K: lambda b: _k_quant_4_5(b, False), Q5_K: lambda b: _k_quant_4_5(b, True)}  # fmt: skip


def row_bytes(type_id: int, columns: int) -> int:
    """Bytes of one row of `columns` values (ValueError when they do not fill whole blocks)."""
    per = BLOCK_ELEMENTS[type_id]
    if columns % per:
        raise ValueError(f"{NAMES[type_id]} rows need a multiple of {per} values, got {columns}")
    return columns // per * BLOCK_BYTES[type_id]


def dequantize(
    raw: np.ndarray | torch.Tensor, type_id: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """The float32 tensor of `shape` (rows last-dim major, torch order) stored as `raw` bytes."""
    if type_id not in NAMES:
        raise ValueError(f"ggml type {type_name(type_id)} is not supported ({supported_list()})")
    data = torch.as_tensor(np.ascontiguousarray(raw)).reshape(-1).view(torch.uint8)
    count = int(np.prod(shape)) if shape else 1
    expected = row_bytes(type_id, shape[-1]) * (count // shape[-1]) if shape else 4
    if data.numel() != expected:
        raise ValueError(
            f"{NAMES[type_id]} tensor of shape {tuple(shape)} needs {expected} bytes, "
            f"has {data.numel()}"
        )
    if type_id == F32:
        out = data.view(torch.float32).clone()
    elif type_id == F16:
        out = data.view(torch.float16).to(torch.float32)
    elif type_id == BF16:
        out = data.view(torch.bfloat16).to(torch.float32)
    else:
        blocks = data.reshape(-1, BLOCK_BYTES[type_id])
        out = _BLOCK_DEQUANT[type_id](blocks)
    return out.reshape(shape)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C `roundf` (halves away from zero), which llama.cpp's quantizers use; computed without
    adding 0.5 (which rounds 0.49999997 up in float32)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def quantize(tensor: torch.Tensor, type_id: int) -> np.ndarray:
    """The raw bytes of `tensor` (last dim a multiple of the block) as `type_id`, a uint8 array
    [rows..., row_bytes] laid out as llama.cpp's reference quantizer (`quantize_row_*_ref`)."""
    x = tensor.detach().to(torch.float32).contiguous()
    shape = tuple(x.shape)
    if type_id == F32:
        return x.numpy().view(np.uint8).reshape(*shape[:-1], -1)
    if type_id == F16:
        return x.to(torch.float16).numpy().view(np.uint8).reshape(*shape[:-1], -1)
    if type_id == BF16:
        return (
            x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(*shape[:-1], -1)
        )
    row_bytes(type_id, shape[-1])  # checks whole blocks
    blocks = x.reshape(-1, 32)
    if type_id == Q8_0:
        amax = blocks.abs().amax(1, keepdim=True)
        d = amax / 127
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = _round_half_away(blocks * inv).to(torch.int8)
        head = d.to(torch.float16).view(torch.uint8)
        body = q.view(torch.uint8)
    elif type_id == Q4_0:
        # the value of largest magnitude, with its sign, maps to -8
        idx = blocks.abs().argmax(1, keepdim=True)
        signed_max = blocks.gather(1, idx)
        d = signed_max / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(blocks * inv + 8.5), max=15).to(torch.uint8)
        head = d.to(torch.float16).view(torch.uint8)
        body = q[:, :16] | (q[:, 16:] << 4)
    else:
        raise ValueError(
            f"writing {type_name(type_id)} is not supported ({', '.join(WRITE_TYPES)})"
        )
    out = torch.cat([head, body], 1)
    return out.numpy().reshape(*shape[:-1], -1)
