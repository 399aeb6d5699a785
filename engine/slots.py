"""A KV-cache pool whose active rows stay packed at the front, for continuous batching.

Shapes: R pool rows, S cache slots per row, K kv heads, D head dim.

The pool is one `models.kv_cache.KVCache` allocated once for `max_rows` rows of `max_seq_len`
slots (a sliding-window model's rows are rings of its window). Active sequences occupy rows
[0, n): a forward over them runs on zero-copy views of those rows, so the model never touches
idle rows. When sequences leave (or beam search reorders its beams) `gather` moves the surviving
rows to the front, copying only the slots in use.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quant_linear import QuantLinear
from models.kv_cache import KVCache
from models.transformer import CausalLM, DecoderLayer


def local_kv_heads(model: CausalLM) -> int:
    """KV heads this process holds: all of them, or its share after tensor-parallel sharding."""
    config = model.config
    layer = next(iter(model.layers.values()))
    assert isinstance(layer, DecoderLayer)
    attn = layer.self_attn
    if attn.fused:
        width = _rows(attn.qkv_proj)
        full = (config.num_attention_heads + 2 * config.kv_heads) * config.head_dim
        return config.kv_heads * width // full
    return _rows(attn.k_proj) // config.head_dim


def _rows(linear: nn.Module) -> int:
    """Output rows this process holds of a linear layer (a quantized one keeps no float weight)."""
    if isinstance(linear, QuantLinear):
        return linear.out_features
    return linear.weight.shape[0]


class SlotPool:
    """Pre-allocated key/value rows shared by every running request of one engine."""

    def __init__(
        self,
        model: CausalLM,
        max_rows: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        param = next(model.parameters())
        self.cache = KVCache(
            model.layers.keys(),
            max_rows,
            max_seq_len,
            local_kv_heads(model),
            model.config.head_dim,
            dtype=dtype or param.dtype,
            device=param.device,
            window=model.config.sliding_window,
        )
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.num_rows = 0

    @property
    def free_rows(self) -> int:
        """Rows not held by any sequence."""
        return self.max_rows - self.num_rows

    def allocate(self, rows: int) -> int:
        """Take `rows` empty rows at the end of the active block; returns the first one."""
        if rows > self.free_rows:
            raise ValueError(f"SlotPool: {rows} row(s) requested, {self.free_rows} free")
        start = self.num_rows
        self.cache.reset_rows(list(range(start, start + rows)))
        self.num_rows += rows
        return start

    def view(self, start: int, stop: int) -> KVCache:
        """A KVCache over rows [start, stop) that writes into the pool (call `sync` after use)."""
        pool = self.cache
        view = KVCache.__new__(KVCache)
        view.k_BSKD = {key: buf[start:stop] for key, buf in pool.k_BSKD.items()}
        view.v_BSKD = {key: buf[start:stop] for key, buf in pool.v_BSKD.items()}
        view.key_mask_BS = pool.key_mask_BS[start:stop]
        view.lengths_B = pool.lengths_B[start:stop].clone()
        view.batch_size = stop - start
        view.max_seq_len = pool.max_seq_len
        return view

    def sync(self, view: KVCache, start: int) -> None:
        """Copy a view's row lengths back (KVCache.commit rebinds them rather than writing)."""
        self.cache.lengths_B[start : start + view.batch_size] = view.lengths_B

    def lengths(self) -> list[int]:
        """Tokens cached per active row."""
        return self.cache.lengths_B[: self.num_rows].tolist()

    def truncate(self, row: int, length: int) -> None:
        """Forget active row `row`'s cached positions from `length` on (speculative decoding
        rolls back rejected draft tokens); its later slots are masked out, so a step over rows
        of unequal length never reads them."""
        assert 0 <= row < self.num_rows and not self.cache.is_ring
        assert 0 <= length <= int(self.cache.lengths_B[row])
        self.cache.lengths_B[row] = length
        self.cache.key_mask_BS[row, length:] = False

    @property
    def slot_capacity(self) -> int:
        """Key/value slots of every row together (rows x max_seq_len, or x the window for rings)."""
        return self.max_rows * self.cache.slots

    def slots_used(self) -> int:
        """Key/value slots the active rows fill: a ring row holds at most its window of tokens."""
        slots = self.cache.slots
        return sum(min(n, slots) for n in self.lengths())

    def copy_row(self, src: int, start: int, stop: int) -> None:
        """Make rows [start, stop) copies of row `src` (a prompt prefilled once for several
        samples of it): its keys and values up to its length, its mask and length."""
        pool = self.cache
        used = min(int(pool.lengths_B[src]), pool.slots)
        for store in (pool.k_BSKD, pool.v_BSKD):
            for buf in store.values():
                buf[start:stop, :used] = buf[src, :used].clone()  # src may be in the range
        pool.key_mask_BS[start:stop] = pool.key_mask_BS[src].clone()
        pool.lengths_B[start:stop] = int(pool.lengths_B[src])

    def gather(self, rows: list[int]) -> None:
        """Keep active rows `rows`, in that order, as the new rows [0, len(rows)).

        A row may appear more than once (beam search duplicating a beam); identity is a no-op.
        """
        if rows == list(range(self.num_rows)):
            return
        pool = self.cache
        m = len(rows)
        if m:
            index = torch.tensor(rows, dtype=torch.long, device=pool.lengths_B.device)
            used = int(pool.lengths_B[index].max())
            for store in (pool.k_BSKD, pool.v_BSKD):
                for buf in store.values():
                    buf[:m, :used] = buf[index, :used]
            pool.key_mask_BS[:m] = pool.key_mask_BS[index]
            pool.lengths_B[:m] = pool.lengths_B[index]
        self.num_rows = m
