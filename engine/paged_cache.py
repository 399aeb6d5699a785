"""A `KVCache` view over block tables: the model's forward reads and writes a paged cache.

Shapes: B rows, T new tokens per row, S key slots read, N blocks, P block size, K kv heads,
D head dim.

Keys and values live in per-layer block buffers [N, P, K, D] (engine/paged_pool.py). A view
holds the block tables of the rows one forward runs over and plans each step in `begin` on the
host: it takes the blocks the new tokens need (copying a block another table shares before
writing into it: copy on write) and computes, once per step, the flat slot of every token
written and of every key read. Each layer then writes its new keys with one `index_copy_` and
gathers the keys its queries see into a contiguous [B, S, K, D] tensor with one index, and runs
the same attention as the dense cache. The gather costs one copy of the keys and values read
(per layer and step, about as many bytes as the attention itself reads): what the block layout
costs over dense rows on the torch path. The C decode step reads the blocks in place
(engine/native_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import attention
from models.kv_cache import CacheStep, KVCache

AllocateBlock = Callable[[int], int]
"""A block for a row's request (its id), with one reference."""


@dataclass
class PagedStep(CacheStep):
    """A `CacheStep` on block tables: the flat slots written and read."""

    write_index_BT: torch.Tensor | None = None
    """Flat slot (block * P + offset) of each new token."""
    read_index_BS: torch.Tensor | None = None
    """Flat slot of each key position read (positions past a row's length name slot 0 and are
    masked)."""
    tables_BN: torch.Tensor | None = None
    """Each row's block table, padded with -1 (the C step reads it)."""


class PagedKVCache(KVCache):
    """Rows of a paged cache: block tables over shared block buffers (see the module doc)."""

    def __init__(
        self,
        k_blocks: dict[str, torch.Tensor],
        v_blocks: dict[str, torch.Tensor],
        tables: list[list[int]],
        lengths: list[int],
        owners: list[int],
        max_seq_len: int,
        allocate: AllocateBlock,
        copy_on_write: Callable[[int, int], int],
    ) -> None:
        self.k_blocks = k_blocks
        """Per layer, keys [N, P, K, D]."""
        self.v_blocks = v_blocks
        """Per layer, values [N, P, K, D]."""
        self.tables = tables
        """Per row, its blocks in order (the pool's own lists: blocks taken here stay there)."""
        self.owners = owners
        """Per row, the request whose credit pays for its new blocks."""
        first = next(iter(k_blocks.values()))
        self.block_size = first.shape[1]
        self.lengths_B = torch.tensor(lengths, dtype=torch.long)
        self.batch_size = len(tables)
        self.max_seq_len = max_seq_len
        self._allocate = allocate
        self._copy_on_write = copy_on_write

    @property
    def slots(self) -> int:
        """Positions a row may hold (no ring: a row's blocks cover all of them)."""
        return self.max_seq_len

    @property
    def is_ring(self) -> bool:
        """Never: sliding-window models keep the dense ring cache."""
        return False

    def begin(self, new_tokens: int, key_padding_mask_BS: torch.Tensor | None) -> PagedStep:
        """Plan a forward of `new_tokens` per row: take and copy-on-write the blocks written,
        index the slots written and read. Rows of unequal length append one token each."""
        if key_padding_mask_BS is not None and not bool(key_padding_mask_BS.all()):
            raise ValueError(
                "PagedKVCache: padded tokens are not stored in blocks; prefill rows of unequal "
                "length separately"
            )
        lengths = self.lengths_B.tolist()
        key_len = max(lengths) + new_tokens
        if key_len > self.max_seq_len:
            raise ValueError(
                f"PagedKVCache: {new_tokens} new token(s) would reach position {key_len} but "
                f"rows hold {self.max_seq_len} (--max-model-len)"
            )
        uniform = min(lengths) == max(lengths)
        if not uniform and new_tokens > 1:
            raise ValueError(
                "PagedKVCache: rows have different lengths, so a step may append only one token "
                f"per row (got {new_tokens})"
            )
        p = self.block_size
        for row, (table, length) in enumerate(zip(self.tables, lengths, strict=True)):
            if length % p and length // p < len(table):
                # The block written next is partly filled: copy it first if shared.
                table[length // p] = self._copy_on_write(table[length // p], self.owners[row])
            while len(table) * p < length + new_tokens:
                table.append(self._allocate(self.owners[row]))
        width = max(len(t) for t in self.tables)
        tables_BN = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables])
        device = first_device(self.k_blocks)
        start_B = self.lengths_B.to(device)
        pos_BT = self.lengths_B[:, None] + torch.arange(new_tokens)
        write_BT = tables_BN.gather(1, pos_BT // p) * p + pos_BT % p
        pos_S = torch.arange(key_len)
        # Positions past a row's end (or its last block) read slot 0 and are masked out.
        read_BS = tables_BN[:, pos_S // p].clamp(min=0) * p + pos_S % p
        mask_BS = None
        if not uniform:
            ends_B1 = (start_B + new_tokens)[:, None]
            mask_BS = torch.arange(key_len, device=device)[None, :] < ends_B1
        return PagedStep(
            start_B,
            new_tokens,
            key_len,
            key_len - new_tokens,
            mask_BS,
            lengths[0] if uniform else None,
            None if uniform else start_B[:, None],
            None,
            write_index_BT=write_BT.to(device),
            read_index_BS=read_BS.to(device),
            tables_BN=tables_BN,
        )

    def write(
        self, layer_id: int | str, step: CacheStep, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for one layer; return every key/value its queries read,
        gathered from the blocks into [B, S, K, D]."""
        assert isinstance(step, PagedStep) and step.write_index_BT is not None
        assert step.read_index_BS is not None
        key = str(layer_id)
        out = []
        for blocks, new_BTKD in ((self.k_blocks[key], k_BSKD), (self.v_blocks[key], v_BSKD)):
            flat = blocks.view(-1, *blocks.shape[2:])
            flat.index_copy_(
                0,
                step.write_index_BT.reshape(-1),
                new_BTKD.reshape(-1, *flat.shape[1:]).to(flat.dtype),
            )
            out.append(flat[step.read_index_BS])
        return out[0], out[1]

    def attend(
        self,
        layer_id: int | str,
        step: CacheStep,
        q_BSHD: torch.Tensor,
        k_BSKD: torch.Tensor,
        v_BSKD: torch.Tensor,
        alibi_slopes_H: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store this step's keys/values, then attend from its queries over every key they see
        (cached and new, causal among the new); out [B, T, H, D]."""
        if window is not None:
            raise ValueError("PagedKVCache: sliding-window models keep the dense ring cache")
        k_all, v_all = self.write(layer_id, step, k_BSKD, v_BSKD)
        out_BSHD = attention(
            q_BSHD,
            k_all,
            v_all,
            causal=True,
            alibi_slopes_H=alibi_slopes_H,
            key_padding_mask_BS=step.key_mask_BS,
            q_offset=step.q_offset,
        )
        assert isinstance(out_BSHD, torch.Tensor)
        return out_BSHD

    def commit(self, step: CacheStep) -> None:
        """Advance every row by the step's tokens (the pool copies the lengths back)."""
        self.lengths_B += step.new_tokens

    def reset(self) -> None:
        """Views are not reset: the pool frees block tables."""
        raise NotImplementedError("PagedKVCache views are not reset; the pool frees tables")

    def rows(self, start: int, stop: int) -> KVCache:
        """Views of views are not taken: the pool builds each view from its tables."""
        raise NotImplementedError("PagedKVCache: take row views from the pool")

    def reset_rows(self, rows_B: torch.Tensor | list[int]) -> None:
        """The pool frees block tables; a view does not."""
        raise NotImplementedError("PagedKVCache: the pool frees block tables")

    def reorder(self, index_B: torch.Tensor) -> None:
        """The pool reorders block tables (`PagedPool.gather`)."""
        raise NotImplementedError("PagedKVCache: reorder rows with PagedPool.gather")


def first_device(blocks: dict[str, torch.Tensor]) -> torch.device:
    """The device the block buffers are on."""
    return next(iter(blocks.values())).device
