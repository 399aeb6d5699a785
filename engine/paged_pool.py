"""The paged KV-cache pool: block buffers, the active rows' block tables, prefix caching.

Shapes: N blocks, P block size (token slots a block), K kv heads, D head dim.

Every layer's keys and values live in [N, P, K, D] buffers allocated once (the budget of
engine/cache_plan.py in blocks). An active row is a block table (its blocks in order) and a
length; rows [0, num_rows) are the engine's decoding rows, in the engine's order. `gather`
reorders and duplicates tables (beam search, finished rows leaving): only block references
move, no key or value is copied until a row writes into a block another table shares (copy on
write, in `PagedKVCache.begin`).

Admission (`admit`): a one-row request (greedy or sampled, n = 1) is promised the blocks of
its prompt not found cached and of its first new token; as it decodes, the engine promises it
each next block before the step that writes into it (`blocks_to_write`, BlockAllocator.cover)
and, when the pool has none left to promise, preempts the most recently admitted one-row request
(`preempt`): its blocks return and it is queued again to recompute its prompt and the tokens it
generated (vLLM's recompute preemption), continuing where it stopped. A request of several rows
(n > 1, beam search) reserves its worst case at admission — the prompt's full blocks not found
cached, plus per row the blocks from its partial prompt block to prompt + max_new_tokens (capped
at --max-model-len) — so it never runs short and is never preempted (its rows diverge after the
prompt: a recompute would need one prompt per row). A request that does not fit its admission
promise waits in the queue. With prefix caching the prompt's
full blocks are looked up by their chained digests (engine/kv_blocks.py), chained from the
namespace of the weights that computed them (the base model's, or a LoRA adapter's), and
shared; at least the prompt's last token is always computed (its logits give the first new
token). A prompt whose next uncached block is being prefilled by an earlier request waits for
it rather than computing it twice.

Generated blocks are cached too (`name_generated`): once a row's block is full of tokens the
sequence has kept, it is registered under the digest chained on from its prompt's, so a
follow-up request whose prompt holds the previous prompt and answer (a chat's next turn) finds
them. A row's chain of digests (`_chains`) follows its table through `gather` and `truncate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.kv_blocks import BlockAllocator, BlockHash, chain_hashes
from engine.paged_cache import PagedKVCache
from engine.requests import GenerationRequest
from engine.slots import local_kv_heads
from engine.validation import rows_needed
from models.transformer import CausalLM


@dataclass
class Prefill:
    """A request admitted into the paged cache whose prompt is not fully computed yet."""

    request: GenerationRequest
    """The request."""
    rows: int
    """Rows it takes once prefilled (its prompt's blocks are shared by all of them)."""
    table: list[int]
    """The prompt's blocks so far (cached ones first)."""
    done: int
    """Prompt tokens whose keys and values are in `table`."""
    cached: int
    """Of those, tokens found in the prefix cache at admission."""
    hashes: list[BlockHash] = field(default_factory=list)
    """Chained digests of the prompt's full blocks."""
    namespace: bytes = b""
    """The digest the chain starts from (the weights' namespace, see `PagedPool.admit`)."""
    tokens: list[int] = field(default_factory=list)
    """The tokens to compute: the prompt, or after a preemption the prompt and the tokens the
    request had generated."""

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.tokens) - self.done


class PagedPool:
    """Block buffers and the block tables of the active rows (see the module doc)."""

    def __init__(
        self,
        model: CausalLM,
        max_rows: int,
        max_seq_len: int,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool,
    ) -> None:
        param = next(model.parameters())
        shape = (num_blocks, block_size, local_kv_heads(model), model.config.head_dim)
        # Uninitialised: the pages of a block become resident when it is first taken (and
        # zeroed then, see `_take`), so memory grows with use up to the budget.
        self.k_blocks = {
            str(i): torch.empty(shape, dtype=param.dtype, device=param.device) for i in model.layers
        }
        self.v_blocks = {key: torch.empty_like(buf) for key, buf in self.k_blocks.items()}
        self._zeroed = [False] * num_blocks
        self.blocks = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        """Reference counts, prefix digests, reservations."""
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.tables: list[list[int]] = []
        self._lengths: list[int] = []
        self._owners: list[int] = []
        # Per active row: the chained digests of its full blocks so far, and the chain's root.
        self._chains: list[list[BlockHash]] = []
        self._roots: list[bytes] = []
        self.prefilling_rows = 0
        """Rows promised to admitted requests still prefilling."""
        self._in_flight: set[BlockHash] = set()

    # -- the SlotPool interface the engine and metrics read ----------------------------------

    @property
    def num_rows(self) -> int:
        """Active (decoding) rows."""
        return len(self.tables)

    @property
    def free_rows(self) -> int:
        """Rows neither decoding nor promised to a prefill."""
        return self.max_rows - self.num_rows - self.prefilling_rows

    def lengths(self) -> list[int]:
        """Tokens cached per active row."""
        return list(self._lengths)

    @property
    def slot_capacity(self) -> int:
        """Token slots of every block."""
        return self.blocks.num_blocks * self.block_size

    def slots_used(self) -> int:
        """Token slots of the blocks some table holds (a shared block counts once)."""
        return self.blocks.used * self.block_size

    def view(self, start: int, stop: int) -> PagedKVCache:
        """A cache over active rows [start, stop) (call `sync` after the forward)."""
        return self.view_of(
            self.tables[start:stop], self._lengths[start:stop], self._owners[start:stop]
        )

    def view_of(
        self, tables: list[list[int]], lengths: list[int], owners: list[int]
    ) -> PagedKVCache:
        """A cache over any block tables (a prefill's before its rows join)."""
        return PagedKVCache(
            self.k_blocks,
            self.v_blocks,
            tables,
            lengths,
            owners,
            self.max_seq_len,
            self._take,
            self._copy_on_write,
        )

    def sync(self, view: PagedKVCache, start: int) -> None:
        """Copy a view's row lengths back after a forward."""
        self._lengths[start : start + view.batch_size] = view.lengths_B.tolist()

    def gather(self, rows: list[int]) -> None:
        """Keep active rows `rows`, in that order (a row may repeat: its blocks are shared)."""
        if rows == list(range(self.num_rows)):
            return
        tables = [list(self.tables[i]) for i in rows]
        for table in tables:
            for block in table:
                self.blocks.incref(block)
        for table in self.tables:
            for block in table:
                self.blocks.decref(block)
        self.tables = tables
        self._lengths = [self._lengths[i] for i in rows]
        self._owners = [self._owners[i] for i in rows]
        self._chains = [list(self._chains[i]) for i in rows]
        self._roots = [self._roots[i] for i in rows]

    def truncate(self, row: int, length: int) -> None:
        """Forget active row `row`'s cached positions from `length` on (speculative decoding
        rolls back rejected drafts): blocks wholly past `length` leave its table (a block no
        other table holds is free again and its request's credit returns); the slots past
        `length` in its last block are overwritten by the next write, never read before."""
        assert 0 <= row < self.num_rows
        assert 0 <= length <= self._lengths[row]
        table = self.tables[row]
        while len(table) * self.block_size >= length + self.block_size:
            self.blocks.decref(table.pop())
        self._lengths[row] = length
        del self._chains[row][length // self.block_size :]

    def name_generated(self, row: int, prompt: list[int], generated: list[int]) -> None:
        """Register active row `row`'s full blocks not yet named, whose tokens are `prompt` +
        `generated`: its sequence's tokens, the last of which is pending (fed next step, not
        cached). Positions past them, such as drafts written but not kept, are never named."""
        if not self.blocks.prefix_caching:
            return
        p = self.block_size
        chain = self._chains[row]
        full = min(self._lengths[row], len(prompt) + len(generated) - 1) // p
        if full <= len(chain):
            return
        first = len(chain) * p
        tokens = prompt[first:] + generated[max(0, first - len(prompt)) :]
        parent = chain[-1] if chain else self._roots[row]
        for digest in chain_hashes(tokens[: (full - len(chain)) * p], p, parent):
            self.blocks.register(self.tables[row][len(chain)], digest)
            chain.append(digest)

    # -- admission and prefill ---------------------------------------------------------------

    def blocks_needed(self, prompt_len: int, config_rows: int, max_new_tokens: int) -> int:
        """Blocks a request may take at most with nothing cached (see the module doc)."""
        p = self.block_size
        total = min(prompt_len + max_new_tokens, self.max_seq_len)
        full = prompt_len // p
        return full + config_rows * (math.ceil(total / p) - full)

    @staticmethod
    def grows(request: GenerationRequest) -> bool:
        """Whether `request` takes its decode blocks as it goes (one row) rather than reserving
        its worst case at admission (several rows; see the module doc)."""
        return rows_needed(request.config) == 1

    def admit(
        self, request: GenerationRequest, namespace: bytes = b"", tokens: list[int] | None = None
    ) -> Prefill | bool | None:
        """Promise `request`'s admission blocks and look up its cached prefix: its Prefill;
        None when the blocks are short (it waits, and so do the requests behind it); False when
        an earlier request is computing its next prompt block (it waits, the ones behind may go).

        `tokens` are what to compute (default: the prompt; a preempted request's prompt and
        generated tokens). `namespace` starts the chain of their block digests: requests
        computed with different weights (a LoRA adapter's, engine/lora_adapters.py) never share
        blocks."""
        rows = rows_needed(request.config)
        if rows > self.free_rows:
            return None
        prompt = request.prompt_ids if tokens is None else tokens
        p = self.block_size
        hashes = chain_hashes(prompt, p, namespace) if self.blocks.prefix_caching else []
        usable = hashes[: (len(prompt) - 1) // p]  # the last prompt token is always computed
        hit = self.blocks.lookup(usable)
        if len(hit) < len(usable) and usable[len(hit)] in self._in_flight:
            return False
        new_tokens = 1 if rows == 1 else request.config.max_new_tokens
        new = self.blocks_needed(len(prompt), rows, new_tokens) - len(hit)
        if not self.blocks.can_reserve(new, hit):
            return None
        self.blocks.reserve(request.request_id, new, hit)
        self.blocks.note_query(len(usable) * p, len(hit) * p)
        self._in_flight.update(hashes[len(hit) :])
        self.prefilling_rows += rows
        done = len(hit) * p
        return Prefill(request, rows, list(hit), done, done, hashes, namespace, list(prompt))

    def blocks_to_write(self, row: int, tokens: int) -> int:
        """Blocks active row `row` takes to write `tokens` more positions (as
        PagedKVCache.begin takes them): a copy of its partly filled last block when shared, and
        the blocks past its table."""
        p = self.block_size
        table, length = self.tables[row], self._lengths[row]
        copies = int(
            bool(length % p) and length // p < len(table) and self.blocks.shared(table[length // p])
        )
        end = min(length + tokens, self.max_seq_len)
        return copies + max(0, math.ceil(end / p) - len(table))

    def preempt(self, row: int) -> None:
        """Active row `row`, the only row of its request, leaves: its blocks go back (full ones
        stay cached by their digests) and so does its request's credit."""
        owner = self._owners[row]
        self.gather([i for i in range(self.num_rows) if i != row])
        self.blocks.release(owner)

    def prefill_view(self, prefills: list[Prefill]) -> PagedKVCache:
        """A cache over the prompt tables of prefills at the same length."""
        return self.view_of(
            [f.table for f in prefills],
            [f.done for f in prefills],
            [f.request.request_id for f in prefills],
        )

    def prefilled(self, prefill: Prefill, tokens: int) -> None:
        """`tokens` more prompt tokens are in the prefill's table: name its full blocks."""
        prefill.done += tokens
        for i in range(prefill.done // self.block_size):
            if i < len(prefill.hashes):
                self.blocks.register(prefill.table[i], prefill.hashes[i])
                self._in_flight.discard(prefill.hashes[i])

    def join(self, prefill: Prefill) -> None:
        """A fully prefilled prompt becomes `prefill.rows` active rows sharing its blocks."""
        for _ in range(prefill.rows - 1):
            for block in prefill.table:
                self.blocks.incref(block)
        for _ in range(prefill.rows):
            self.tables.append(list(prefill.table))
            self._lengths.append(prefill.done)
            self._owners.append(prefill.request.request_id)
            self._chains.append(list(prefill.hashes))
            self._roots.append(prefill.namespace)
        self.prefilling_rows -= prefill.rows

    def abandon(self, prefill: Prefill) -> None:
        """A prefill that will not finish (cancelled or failed): its blocks and rows go back."""
        for block in prefill.table:
            self.blocks.decref(block)
        self._in_flight.difference_update(prefill.hashes)
        self.prefilling_rows -= prefill.rows
        prefill.table.clear()
        self.blocks.release(prefill.request.request_id)

    def settle(self, running: set[int]) -> None:
        """Return the unused reservations of requests that hold no row and no prefill."""
        for request_id in list(self.blocks.reserved_by()):
            if request_id not in running:
                self.blocks.release(request_id)

    def reset(self) -> None:
        """Forget every row, prefill, reservation and cached prefix."""
        self.tables, self._lengths, self._owners = [], [], []
        self._chains, self._roots = [], []
        self.prefilling_rows = 0
        self._in_flight.clear()
        self.blocks.reset()

    def _take(self, owner: int) -> int:
        """A block for `owner` (BlockAllocator.allocate), zeroed on its first use: attention
        gives the slots past a row's end weight 0, and 0 x a NaN left in memory is NaN."""
        block = self.blocks.allocate(owner)
        if not self._zeroed[block]:
            for store in (self.k_blocks, self.v_blocks):
                for buf in store.values():
                    buf[block].zero_()
            self._zeroed[block] = True
        return block

    def _copy_on_write(self, block: int, owner: int) -> int:
        """`block`, or a private copy of it for `owner` when another table shares it."""
        if not self.blocks.shared(block):
            return block
        copy = self._take(owner)
        for store in (self.k_blocks, self.v_blocks):
            for buf in store.values():
                buf[copy] = buf[block]
        self.blocks.decref(block)
        return copy
