"""KV-cache blocks: who holds each block, which prompt prefix it caches, which block goes next.

A paged KV cache (engine/paged_pool.py) stores keys and values in fixed-size blocks of
`block_size` token slots; each sequence has a block table naming its blocks in order. This
module is the bookkeeping, with no tensors:

- reference counts: a block is held by every block table naming it (the rows of an `n > 1`
  request or of a beam search share their prompt's blocks; requests share a cached prefix);
- prefix hashes: a full block of tokens (a prompt's, or an answer's once generated) is named by
  a digest of its tokens chained with its prefix's digest (as vLLM's automatic prefix caching),
  so a later request whose prompt starts with the same tokens finds the blocks already computed;
- eviction: a cached block nobody holds stays cached until a new block is needed and no
  never-used block is left; then the least recently released cached block is reused (LRU);
- credits: each admitted request may take at most the blocks promised to it. A request of
  several rows (n > 1, beam search) is promised its worst case at admission; a one-row request
  is promised its prompt (and first new token) at admission and more as it decodes (`cover`,
  before each step): when no free block is left to promise, the engine preempts the most
  recently admitted one-row request (engine/engine.py), whose blocks come back here.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

BlockHash = bytes
"""Digest naming a full block of tokens and every token before it."""


def chain_hashes(tokens: list[int], block_size: int, parent: BlockHash = b"") -> list[BlockHash]:
    """Digest of each full block of `tokens`, each chained with the digest of the blocks before.

    A 16-byte BLAKE2b over the parent digest and the block's token ids (int64 little-endian): a
    collision would silently serve another prompt's keys, so no 64-bit Python hash."""
    out: list[BlockHash] = []
    for first in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[first : first + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in block))
        parent = digest.digest()
        out.append(parent)
    return out


@dataclass
class PrefixStats:
    """Prefix-cache lookups since start (the hit rate is hit_tokens / queried_tokens)."""

    queried_tokens: int = 0
    """Prompt tokens in full blocks looked up at admission."""
    hit_tokens: int = 0
    """Of those, tokens whose keys and values were found cached."""


@dataclass
class _Credit:
    """A running request's blocks still to take (its reservation less what it holds)."""

    left: int
    """Blocks it may still allocate."""
    held: set[int] = field(default_factory=set)
    """Blocks it allocated and that are still referenced (a freed one returns its credit)."""


class BlockAllocator:
    """Reference-counted blocks with a prefix-hash index and LRU eviction of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockAllocator: {num_blocks} blocks of {block_size} slots")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        """Whether full blocks are hashed and shared (--enable-prefix-caching)."""
        self.stats = PrefixStats()
        self.reset()

    def reset(self) -> None:
        """Forget every table, reservation and cached prefix (the statistics stay)."""
        num_blocks = self.num_blocks
        self.refs = [0] * num_blocks
        self._never_cached = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._credits: dict[int, _Credit] = {}
        self._owner: dict[int, int] = {}

    # -- counts ------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Blocks that can be taken now: never used, or cached and unreferenced (evictable)."""
        return len(self._never_cached) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks some block table holds."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Unreferenced blocks kept for their prefix (reused first come, LRU evicted)."""
        return len(self._evictable)

    @property
    def reserved(self) -> int:
        """Blocks running requests may still take (admission leaves them free)."""
        return sum(c.left for c in self._credits.values())

    # -- admission ---------------------------------------------------------------------------

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not yet held; see `reserve`)."""
        if not self.prefix_caching:
            return []
        out = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            out.append(block)
        return out

    def can_reserve(self, new_blocks: int, hit: list[int]) -> bool:
        """Whether `new_blocks` more blocks can be promised while holding the cached `hit`
        blocks (an unreferenced hit block stops being evictable, so it counts as taken)."""
        taken = sum(1 for b in hit if self.refs[b] == 0)
        return new_blocks + taken <= self.free - self.reserved

    def reserve(self, request_id: int, new_blocks: int, hit: list[int]) -> None:
        """Promise `new_blocks` blocks to `request_id` and take a reference on each `hit` block
        (the caller checked `can_reserve`)."""
        assert request_id not in self._credits
        for block in hit:
            self.incref(block)
        self._credits[request_id] = _Credit(new_blocks)

    def cover(self, request_id: int, blocks: int) -> bool:
        """Make sure `request_id` may take `blocks` more blocks, promising it the shortfall out
        of the unpromised free blocks; False (nothing promised) when too few are left."""
        credit = self._credits[request_id]
        short = blocks - credit.left
        if short <= 0:
            return True
        if short > self.free - self.reserved:
            return False
        credit.left += short
        return True

    def release(self, request_id: int) -> None:
        """A request left: its unused credit returns (its blocks are freed by their tables)."""
        credit = self._credits.pop(request_id, None)
        if credit is not None:
            for block in credit.held:
                self._owner.pop(block, None)

    def reserved_by(self) -> list[int]:
        """Ids of the requests holding a reservation."""
        return list(self._credits)

    def note_query(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admission's prefix lookup (metrics)."""
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    # -- blocks ------------------------------------------------------------------------------

    def allocate(self, request_id: int) -> int:
        """A block for `request_id`, out of its credit, with one reference: a never-used block,
        else the least recently released cached one (its prefix is forgotten)."""
        credit = self._credits.get(request_id)
        if credit is None or credit.left < 1:
            raise RuntimeError(
                f"KV blocks: request {request_id} needs a block beyond its reservation"
            )
        if self._never_cached:
            block = self._never_cached.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:  # reservations never exceed the free blocks
            raise RuntimeError("KV blocks: none free although reserved")
        credit.left -= 1
        credit.held.add(block)
        self._owner[block] = request_id
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more table holds `block`."""
        if self.refs[block] == 0:
            self._evictable.pop(block, None)
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        """One table less holds `block`; unreferenced, it is cached (hashed) or free again, and
        its allocating request (if running) gets its credit back."""
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than held"
        if self.refs[block] > 0:
            return
        owner = self._owner.pop(block, None)
        if owner is not None:
            credit = self._credits[owner]
            credit.held.discard(block)
            credit.left += 1
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            self._never_cached.append(block)

    def register(self, block: int, digest: BlockHash) -> None:
        """Name a full, written block by its prefix digest so later prompts can share it (the
        first block computed for a digest stays its cached copy)."""
        if not self.prefix_caching or digest in self._by_hash or block in self._hash_of:
            return
        self._by_hash[digest] = block
        self._hash_of[block] = digest

    def is_registered(self, digest: BlockHash) -> bool:
        """Whether a block with this prefix digest is cached."""
        return digest in self._by_hash

    def shared(self, block: int) -> bool:
        """Whether writing into `block` must copy it first: another table holds it, or it
        caches a prefix (its keys must stay those of its digest)."""
        return self.refs[block] > 1 or block in self._hash_of
