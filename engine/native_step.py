"""CPU decode steps in one C call (engine/cpu_decode.c): the default where they apply.

Shapes: B rows, E hidden, H heads, K kv heads, D head dim, F ffn, V vocab, S cache slots.

A decode step streams every weight once, and the lean step (engine/decode_step.py) still runs
~30 small torch ops a layer between the matrix products. Each comes right after a product has
flushed the core's caches, so it costs 5-40 us instead of 1-3: a hidden-1024 batch-1 step spent
~2 ms of its ~10 there (bench/RESULTS.md). `NativeStep` runs the same decoder as a single C loop
over the model's own tensors (nothing is copied): every step of one row, and steps of up to
C_ROWS rows when the weights it reads are row-major (as loaded, or a packed layer's dense copy);
larger steps run the lean step, where oneDNN's packed product is faster. bf16 steps of up to
MAX_ROWS rows run here (oneDNN packs fp32 only, and torch's bf16 step is slow on CPUs without
bf16 units).

Covered: CPU, fp32 or bf16 (bf16 weights, norms, embedding and KV cache are widened as they
are read and the arithmetic is fp32; new keys and values are rounded to bf16 as they are
written), the decoder `DecodeStep` covers with fused q|k|v (biases allowed) and a
fused gate|up SwiGLU, no q/k norms, plain weights, row- or column-major (nn.Linear, or a packed
layer's one-row copy), a cache that is not a sliding-window ring; the lean step keeps the rest.
The sums run in another order than torch's, so logits agree with the lean step to fp32 rounding
(tested), not bit for bit; greedy tokens are HF's in the parity tests. `--decode-step lean`
keeps the bit-identical step. Weight-only quantized layers (kernels/quant_linear.py: int8 or
int4 codes, groups of a multiple of 8 inputs) are read as codes (engine/cpu_decode_quant.h).
For bf16 models the prefill runs in C too (`NativeStep.prefill`).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine.config_support import FieldSupport, declined, every, only
from engine.decode_step import LEAN_SUPPORT, DecodeStep, DenseLinear, StepLayer
from engine.paged_cache import PagedKVCache, PagedStep
from kernels.packed_linear import PackedLinear
from kernels.quant_embedding import QuantEmbedding
from kernels.quant_linear import QuantLinear
from models.kv_cache import CacheStep, KVCache

log = logging.getLogger(__name__)

NATIVE_SUPPORT: dict[str, FieldSupport] = {
    **LEAN_SUPPORT,
    "qk_norm": only(False, why="cpu_decode.c has no per-head q/k norms"),
    "fused_qkv": only(
        True, why="cpu_decode.c reads one fused q|k|v matrix, not separate projections"
    ),
    "fused_gate_up": only(
        True, why="cpu_decode.c reads one fused gate|up matrix, not separate projections"
    ),
    "attention_bias": every("cpu_decode.c adds each linear layer's bias"),
}
"""The C step's row for every ModelConfig field: the lean step's (it runs around it) with what
cpu_decode.c adds or lacks (engine/config_support.py)."""

MAX_ROWS = 64
"""Rows per step cpu_decode.c accepts."""
C_ROWS = 8
"""Steps of up to this many rows run in C when the weights it reads are row-major. Measured on
a 2-core x86-64 box (bench/RESULTS.md): at 8 rows the C step beat the lean step with its best
layout (hidden 256: 1.37 vs 1.76 ms, column-major; hidden 1024: 15.5 vs 19.9 ms, oneDNN-packed);
at 32 rows oneDNN's packed product won (28.5 vs 36.7 ms)."""

try:  # built at install where a compiler is present (cpu_decode.c)
    import engine.cpu_decode as _compiled
except ImportError:  # pragma: no cover - depends on the install
    _compiled = None


class _Lin(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("out", ctypes.c_long),
        ("in_", ctypes.c_long),
        ("rs", ctypes.c_long),
        ("cs", ctypes.c_long),
        ("qbits", ctypes.c_long),
        ("group", ctypes.c_long),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
    ]


class _LayerTable(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("qkv", _Lin),
        ("o", _Lin),
        ("gate_up", _Lin),
        ("down", _Lin),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("rs", ctypes.c_long),
        ("ss", ctypes.c_long),
        ("ks", ctypes.c_long),
    ]


class _ModelTable(ctypes.Structure):
    _fields_ = [
        ("E", ctypes.c_long),
        ("H", ctypes.c_long),
        ("K", ctypes.c_long),
        ("D", ctypes.c_long),
        ("F", ctypes.c_long),
        ("V", ctypes.c_long),
        ("L", ctypes.c_long),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("final_eps", ctypes.c_float),
        ("head", _Lin),
        ("inv_freq", ctypes.c_void_p),
        ("rope_scale", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_LayerTable)),
        ("dtype", ctypes.c_long),
        ("qembed", _Lin),
    ]


DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Storage types cpu_decode.c reads (its DTYPE_F32, DTYPE_BF16, DTYPE_F16); it computes in fp32."""


def available() -> tuple[bool, str]:
    """Whether the compiled step is installed and this CPU runs it, and why not."""
    if _compiled is None:
        return False, "engine.cpu_decode was not built (no C compiler at install, or not x86-64)"
    if not hasattr(_compiled, "block_tables"):
        return False, "engine.cpu_decode is an older build without block tables; rebuild it"
    if not _compiled.simd():
        return False, "this CPU lacks AVX2/FMA/F16C, which engine.cpu_decode is built for"
    lin_bytes = getattr(_compiled, "lin_bytes", None)
    model_bytes = getattr(_compiled, "model_bytes", None)
    if (
        lin_bytes is None
        or lin_bytes() != ctypes.sizeof(_Lin)
        or model_bytes is None
        or model_bytes() != ctypes.sizeof(_ModelTable)
    ):
        return False, (
            "engine.cpu_decode was built from an older cpu_decode.c (another table layout); "
            "rebuild it (build_ext --inplace)"
        )
    return True, "built"


class Unsupported(Exception):
    """The step's model has a part the C step does not cover (the lean step runs instead)."""


def _check_layer_shapes(
    lean: DecodeStep, layers: list[tuple[Parts, Parts, Parts, Parts]], hidden: int
) -> tuple[int, int, int]:
    """(heads, kv heads, ffn size) once every layer's matrices and norms have the sizes the C
    loop trusts (Unsupported otherwise: the lean step runs)."""
    first = lean.layers[0]
    heads = first.q_size // lean.head_dim
    kv_heads = first.kv_size // lean.head_dim
    ffn = _shape(layers[0][2][0])[0] // 2
    if heads * lean.head_dim != first.q_size or heads % max(kv_heads, 1) or lean.head_dim % 2:
        raise Unsupported("heads that do not split into whole kv-head groups of even size")
    for parts in layers:  # the C loop trusts these sizes: any mismatch keeps the lean step
        _expect(parts[0], (heads + 2 * kv_heads) * lean.head_dim, hidden, "q|k|v")
        _expect(parts[1], hidden, heads * lean.head_dim, "o")
        _expect(parts[2], 2 * ffn, hidden, "gate|up")
        _expect(parts[3], hidden, ffn, "down")
    norms = [lean.final_norm[0]] + [n for ly in lean.layers for n in (ly.norm1[0], ly.norm2[0])]
    for norm in norms:
        if norm.shape != (hidden,):
            raise Unsupported(f"a norm weight of shape {tuple(norm.shape)}, not ({hidden},)")
    return heads, kv_heads, ffn


class NativeStep:
    """`DecodeStep(ids_B1, cache, step)` in one C call, for up to `max_rows` rows; other calls
    go to `lean`."""

    def __init__(self, lean: DecodeStep) -> None:
        ok, why = available()
        if not ok:
            raise Unsupported(why)
        reason = declined(lean.config, NATIVE_SUPPORT)
        if reason is not None:
            raise Unsupported(reason)
        self.config = lean.config
        self.lean = lean
        embedding = lean.embedding
        self.dtype = lean.dtype
        hidden = self._check_embedding(lean)
        layers = [_layer_parts(layer, self.dtype) for layer in lean.layers]
        heads, kv_heads, ffn = _check_layer_shapes(lean, layers, hidden)
        self._keep: list[torch.Tensor] = []  # every tensor the tables point to stays alive
        self._layers = (_LayerTable * len(layers))()
        for table, layer, (qkv, o, gate_up, down) in zip(
            self._layers, lean.layers, layers, strict=True
        ):
            table.norm1, table.eps1 = self._ptr(layer.norm1[0]), layer.norm1[1]
            table.norm2, table.eps2 = self._ptr(layer.norm2[0]), layer.norm2[1]
            table.qkv, table.o = self._lin(*qkv), self._lin(*o)
            table.gate_up, table.down = self._lin(*gate_up), self._lin(*down)
        head, qembed = self._head_tables(lean, hidden)
        if lean.inv_freq.numel() != lean.head_dim // 2:
            raise Unsupported("RoPE over part of the head dim")
        self._model = _ModelTable(
            E=hidden,
            H=heads,
            K=kv_heads,
            D=lean.head_dim,
            F=ffn,
            V=_shape(head[0])[0],
            L=len(layers),
            embed=0 if isinstance(embedding, QuantEmbedding) else self._ptr(embedding),
            final_norm=self._ptr(lean.final_norm[0]),
            final_eps=lean.final_norm[1],
            head=self._lin(*head),
            inv_freq=self._ptr(lean.inv_freq.to(torch.float32).contiguous()),
            rope_scale=lean.rope_scale,
            scale=lean.scale,
            layers=self._layers,
            dtype=DTYPES[self.dtype],
            qembed=qembed,
        )
        self._model_addr = ctypes.addressof(self._model)
        linears = [
            lean.head,
            *(f for ly in lean.layers for f in (ly.qkv, ly.o, ly.gate_up, ly.down)),
        ]
        several = C_ROWS if self.dtype == torch.float32 else MAX_ROWS
        self.max_rows = several if all(_row_major(f, self.dtype) for f in linears) else 1
        """Rows a step may have to run here: with row-major weights up to C_ROWS in fp32 (where
        oneDNN's packed product wins beyond) and MAX_ROWS in bf16 and fp16, which oneDNN does
        not pack (torch's bf16 step took 101-363 ms at 16-64 rows of the hidden-1024 bench
        model, this one 18-58 ms); else one (the C product over column-major weights is slower
        than MKL's at several rows)."""
        self._cache: tuple[int, ...] = ()  # the cache rows the tables point at now
        self._block_size = 0  # a paged cache's block size (what _point_at last saw)
        self._scratch = torch.empty(0)
        m = self._model
        # cpu_decode.c's scratch per row, besides H scores per slot: h, x, q|k|v, attention
        # out, gate|up, act, cos, sin
        self._row_scratch = 2 * m.E + (m.H + 2 * m.K) * m.D + m.H * m.D + 3 * m.F + m.D

    def _check_embedding(self, lean: DecodeStep) -> int:
        """The hidden size, once the embedding and final norm are what C reads (Unsupported
        otherwise)."""
        embedding = lean.embedding
        if isinstance(embedding, QuantEmbedding):  # rows dequantized in C from the codes
            if _quantized(embedding.tied_linear(), self.dtype) is None:
                raise Unsupported("the quantized embedding's codes are not what C reads")
            tensors = [lean.final_norm[0]]
            hidden, embed_ptr = embedding.embedding_dim, 0
        else:
            tensors = [embedding, lean.final_norm[0]]
            hidden = embedding.shape[1]
            embed_ptr = embedding.data_ptr() if embedding.is_contiguous() else None
        if self.dtype not in DTYPES or any(
            t.device.type != "cpu" or t.dtype != self.dtype for t in tensors
        ):
            raise Unsupported("not an fp32, bf16 or fp16 model on the CPU")
        if embed_ptr is None:
            raise Unsupported("the embedding is not contiguous")
        return hidden

    def _head_tables(self, lean: DecodeStep, hidden: int) -> tuple[Parts, _Lin]:
        """The head's (weight, ...) parts and the quantized embedding's table (empty when the
        embedding is plain)."""
        head = _plain(lean.head, self.dtype)
        if head is None:
            raise Unsupported(f"the head's weight is not a plain {self.dtype} matrix")
        vocab = _shape(head[0])[0]
        _expect(head, vocab, hidden, "head")
        qembed = _Lin()
        embedding = lean.embedding
        if isinstance(embedding, QuantEmbedding):
            if embedding.num_embeddings != vocab:
                raise Unsupported("a quantized embedding of another vocabulary than the head's")
            qembed = self._lin(embedding.tied_linear(), None)
        return head, qembed

    @classmethod
    def build(cls, lean: DecodeStep | None) -> tuple[NativeStep | None, str]:
        """The C step around `lean`, or None and why the lean step runs every step."""
        if lean is None:
            return None, "no lean step"
        try:
            return cls(lean), "covered"
        except Unsupported as exc:
            return None, str(exc)

    def __call__(self, ids_B1: torch.Tensor, cache: KVCache, step: CacheStep) -> torch.Tensor:
        """Logits [B, V], as `DecodeStep.__call__` (more than `max_rows` rows, or a ring cache,
        go to the lean step)."""
        rows = ids_B1.shape[0]
        if rows > self.max_rows or cache.is_ring or step.ring_prefill is not None:
            return self.lean(ids_B1, cache, step)
        self._point_at(cache, rows, step)
        ids = ids_B1.reshape(rows).to(torch.long).contiguous()
        positions = step.start_B.to(torch.long).contiguous()
        logits_BV = torch.empty(rows, self._model.V)
        self._run(rows, ids, positions, None, step, logits_BV)
        return logits_BV

    def prefill(self, ids_BS: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits [B, V] of each row's last position after appending prompts `ids_BS` to the
        `cache` rows, in C, for a bf16 or fp16 model; None (and the cache untouched) otherwise,
        for the model forward to run.

        Each prompt token is a row of a call, at its position, reading and writing its prompt's
        cache row; in a call every row writes its key and value before any attends, and the
        tokens go in calls of up to MAX_ROWS in order (row by row, position by position), so
        each token sees its prompt up to itself, as in the model's causal forward. Only 16-bit
        models: torch's bf16 forward is slow on a CPU without bf16 units (~90 against ~15 ms for
        16 tokens of the hidden-1024 bench model) and its fp16 forward slower still, while fp32
        prefills keep the model forward, which oneDNN's packed weights run about as fast and
        which keeps them bit-identical."""
        rows, length = ids_BS.shape
        if self.dtype == torch.float32 or cache.is_ring or rows > MAX_ROWS:
            return None
        step = cache.begin(length, None)
        self._point_at(cache, rows, step)
        tokens = ids_BS.reshape(-1).to(torch.long).contiguous()
        positions = (step.start_B[:, None] + torch.arange(length)).reshape(-1).contiguous()
        cache_rows = torch.arange(rows).repeat_interleave(length)
        logits = torch.empty(min(rows * length, MAX_ROWS), self._model.V)
        last = torch.empty(rows, self._model.V)
        for first in range(0, rows * length, MAX_ROWS):
            count = min(MAX_ROWS, rows * length - first)
            self._run(count, tokens[first:], positions[first:], cache_rows[first:], step, logits)
            for token in range(first + length - 1 - first % length, first + count, length):
                last[token // length] = logits[token - first]
        cache.commit(step)
        return last

    def verify(self, ids_S: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits [S, V] of every position after appending `ids_S` to a one-row `cache`, in one
        C call (speculative decoding's verification: each token a row at its position over the
        same cache row, as `prefill` runs a prompt, so the weights are read once for all S);
        None (and the cache untouched) beyond `max_rows` tokens or on a ring, for the model
        forward to run."""
        count = ids_S.shape[0]
        if count > self.max_rows or cache.is_ring or cache.batch_size != 1:
            return None
        step = cache.begin(count, None)
        self._point_at(cache, 1, step)
        tokens = ids_S.to(torch.long).contiguous()
        positions = (step.start_B[0] + torch.arange(count)).contiguous()
        logits_SV = torch.empty(count, self._model.V)
        self._run(count, tokens, positions, torch.zeros(count, dtype=torch.long), step, logits_SV)
        cache.commit(step)
        return logits_SV

    def _run(
        self,
        rows: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor | None,
        step: CacheStep,
        logits: torch.Tensor,
    ) -> None:
        """One C call: `rows` rows of `tokens` at `positions` (int64, contiguous) over the
        cache rows the tables point at (`cache_rows`, default each row its own), seeing the
        slots `step`'s mask leaves; logits of each row into `logits`."""
        mask = step.key_mask_BS
        if mask is not None and mask.stride(1) != 1:
            mask = mask.contiguous()
        tables = step.tables_BN if isinstance(step, PagedStep) else None
        if tables is not None:  # the C step reads keys 0..position of each row, no mask
            mask = None
            tables = tables.contiguous()
        need = rows * (self._row_scratch + self._model.H * step.key_len)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()))
        _compiled.step(
            self._model_addr,
            rows,
            tokens.data_ptr(),
            positions.data_ptr(),
            0 if mask is None else mask.data_ptr(),
            0 if mask is None else mask.stride(0),
            logits.data_ptr(),
            self._scratch.data_ptr(),
            torch.get_num_threads(),
            0 if cache_rows is None else cache_rows.data_ptr(),
            0 if tables is None else tables.data_ptr(),
            0 if tables is None else tables.shape[1],
            0 if tables is None else self._block_size,
        )

    def _point_at(self, cache: KVCache, rows: int, step: CacheStep) -> None:
        """Aim each layer's table at `cache` (views can move between calls), after checking that
        it holds `rows` rows of at least the step's key_len slots of the model's dtype. A paged
        cache: at its block buffers (the step's block tables say where each row's slots are)."""
        key_len = step.key_len
        if isinstance(cache, PagedKVCache):
            assert isinstance(step, PagedStep) and step.tables_BN is not None
            kv = [(cache.k_blocks[ly.key], cache.v_blocks[ly.key]) for ly in self.lean.layers]
            self._block_size = cache.block_size
            if step.tables_BN.shape[0] != rows:
                raise ValueError(
                    f"NativeStep: {step.tables_BN.shape[0]} block tables for {rows} rows"
                )
        else:
            kv = [(cache.k_BSKD[ly.key], cache.v_BSKD[ly.key]) for ly in self.lean.layers]
        k0 = kv[0][0]
        if not isinstance(cache, PagedKVCache) and (k0.shape[0] != rows or k0.shape[1] < key_len):
            raise ValueError(
                f"NativeStep: a cache of {k0.shape[0]} rows x {k0.shape[1]} slots for {rows} rows "
                f"up to slot {key_len - 1}"
            )
        where = tuple(x for pair in kv for t in pair for x in (t.data_ptr(), *t.stride()))
        if where == self._cache:
            return
        for table, (k, v) in zip(self._layers, kv, strict=True):
            if k.dtype != self.dtype or k.stride(3) != 1 or k.stride() != v.stride():
                raise ValueError(
                    f"NativeStep: the KV cache is not {self.dtype} with contiguous head dims"
                )
            table.k, table.v = k.data_ptr(), v.data_ptr()
            table.rs, table.ss, table.ks = k.stride(0), k.stride(1), k.stride(2)
        self._cache = where

    def _ptr(self, tensor: torch.Tensor) -> int:
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _lin(self, weight: torch.Tensor | QuantLinear, bias: torch.Tensor | None) -> _Lin:
        if isinstance(weight, QuantLinear):  # codes read by cpu_decode_quant.h
            codes = weight.codes if weight.bits == 8 else weight.packed
            return _Lin(
                w=self._ptr(codes),
                b=0 if bias is None else self._ptr(bias),
                out=weight.out_features,
                in_=weight.in_features,
                rs=codes.stride(0),
                cs=1,
                qbits=weight.bits,
                group=weight.group_size,
                scale=self._ptr(weight.scale),
                zero=0 if weight.zero is None else self._ptr(weight.zero),
            )
        return _Lin(
            w=self._ptr(weight),
            b=0 if bias is None else self._ptr(bias),
            out=weight.shape[0],
            in_=weight.shape[1],
            rs=weight.stride(0),
            cs=weight.stride(1),
        )


Parts = tuple[torch.Tensor | QuantLinear, torch.Tensor | None]


def _layer_parts(layer: StepLayer, dtype: torch.dtype) -> tuple[Parts, Parts, Parts, Parts]:
    """(weight, bias) of q|k|v, o, gate|up and down, each a plain `dtype` matrix, or
    Unsupported."""
    if layer.qkv is None or layer.gate_up is None:
        raise Unsupported(f"layer {layer.key}: separate q/k/v or gate/up projections")
    if layer.q_norm is not None:
        raise Unsupported(f"layer {layer.key}: q/k norms")
    for norm in (layer.norm1[0], layer.norm2[0]):
        if norm.dtype != dtype or not norm.is_contiguous():
            raise Unsupported(f"layer {layer.key}: a norm weight that is not contiguous {dtype}")
    parts = [_plain(f, dtype) for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if any(p is None for p in parts):
        raise Unsupported(
            f"layer {layer.key}: a weight that is not a plain {dtype} matrix (packed?)"
        )
    return tuple(parts)  # type: ignore[return-value]


def _expect(parts: Parts, out: int, in_: int, name: str) -> None:
    weight, bias = parts
    shape = _shape(weight)
    if shape != (out, in_) or (bias is not None and tuple(bias.shape) != (out,)):
        raise Unsupported(f"{name}: weight {shape}, expected ({out}, {in_})")


def _shape(weight: torch.Tensor | QuantLinear) -> tuple[int, int]:
    """[out, in] of a weight matrix or a quantized layer's weight."""
    if isinstance(weight, QuantLinear):
        return weight.out_features, weight.in_features
    return weight.shape[0], weight.shape[1]


def _row_major(linear: object, dtype: torch.dtype) -> bool:
    """Whether the weight the C step reads for `linear` is row-major (a quantized layer's
    codes are)."""
    parts = _plain(linear, dtype)
    return parts is not None and (isinstance(parts[0], QuantLinear) or parts[0].stride(-1) == 1)


def _plain(linear: object, dtype: torch.dtype) -> Parts | None:
    """The layer's (weight [O, I], bias) when both are of `dtype` and the weight is a plain
    row-major or column-major matrix, else None: a plain linear (DecodeStep's DenseLinear, as
    loaded or `--cpu-linear colmajor`) or a packed layer's one-row copy."""
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    if isinstance(linear, QuantLinear):
        return _quantized(linear, dtype)
    if isinstance(linear, PackedLinear):
        weight, bias = linear.gemv_weight, linear.bias
    elif isinstance(linear, DenseLinear):
        weight, bias = linear.weight, linear.bias
    else:
        return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if weight.dtype != dtype or weight.device.type != "cpu":
        return None
    rows, cols = weight.shape
    if not (weight.stride() == (cols, 1) or weight.stride() == (1, rows)):
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return weight, bias


def _quantized(linear: QuantLinear, dtype: torch.dtype) -> Parts | None:
    """(the layer, its bias) when cpu_decode_quant.h reads it: CPU codes, scales and zero points
    as QuantLinear makes them, groups of a multiple of 8 inputs, a `dtype` bias; else None."""
    codes = linear.codes if linear.bits == 8 else linear.packed
    tensors = [codes, linear.scale] + ([] if linear.zero is None else [linear.zero])
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    kinds = (codes.dtype, linear.scale.dtype, None if linear.zero is None else linear.zero.dtype)
    expected = (torch.int8 if linear.bits == 8 else torch.uint8, torch.float32)
    if kinds[:2] != expected or kinds[2] not in (None, torch.int8):
        return None  # e.g. scales cast by a model-wide .to(dtype): the torch forward copes
    if linear.group_size % 8:
        return None
    bias = linear.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return linear, bias
