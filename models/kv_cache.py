"""Pre-allocated key/value cache for incremental decoding.

Shapes: B batch, S sequence (max_S = cache capacity), K kv heads, D head dim.

Per layer (keyed by the global layer index, so a pipeline stage's cache holds only its layers)
the cache keeps `k_BSKD` / `v_BSKD` buffers of shape [B, max_S, K, D] (head-major in memory),
plus one boolean `key_mask_BS` [B, max_S] (True = real token, False = padding) and `lengths_B`,
the number of positions written per row. A model forward with `kv_cache=` calls `begin()` once, each attention
layer calls `attend()` (its `write()`, then attention over every key its queries see), and the
forward ends with `commit()`, which advances the lengths; until then a failed forward leaves the
cache as it was.

With a sliding window W shorter than max_seq_len (Mistral) each row is a ring of W slots instead
(position p at slot p mod W; `models/kv_ring.py`): memory is bounded by the window, `lengths_B`
still counts positions, and max_seq_len still bounds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.attention import attention
from models.kv_ring import RingPrefill

if TYPE_CHECKING:
    from models.transformer import CausalLM


@dataclass
class CacheStep:
    """Where one forward writes: its new tokens' slots and the keys its queries may see."""

    start_B: torch.Tensor
    """First slot written per row (the row's length before this step)."""
    new_tokens: int
    """Tokens appended to every row in this step."""
    key_len: int
    """Slots the attention reads (the longest row's length after this step)."""
    q_offset: int
    """Index of the first query relative to the first key, as `kernels.attention` expects."""
    key_mask_BS: torch.Tensor | None
    """Keys visible per row over the first key_len slots (None when every slot is visible)."""
    start: int | None
    """The slot every row starts at, or None when rows differ (then one token per row)."""
    slots_B: torch.Tensor | None = None
    """Rows of unequal length: the slot each row writes (indexed writes, computed once per step
    rather than per layer)."""
    plan_3: torch.Tensor | None = None
    """(start or -1, key_len, q_offset) as a host int64 tensor: what the cache op of a compiled
    forward reads (Python ints there would be baked into the graph, one graph per length)."""
    ring: bool = False
    """Sliding-window ring, one token per row: the slots are positions mod W and every stored
    key is inside the window, so attention reads the slots with the key mask alone (no window)."""
    ring_prefill: RingPrefill | None = None
    """Sliding-window ring, several tokens reaching past the ring: how they read and write it."""

    @classmethod
    def from_plan(
        cls,
        plan_3: torch.Tensor,
        start_B: torch.Tensor,
        new_tokens: int,
        key_mask_BS: torch.Tensor | None,
    ) -> CacheStep:
        """The step `KVCache.begin` planned, rebuilt from its tensors (inside the cache op)."""
        start, key_len, q_offset = plan_3.tolist()
        uniform = start >= 0
        return cls(
            start_B,
            new_tokens,
            key_len,
            q_offset,
            key_mask_BS,
            start if uniform else None,
            None if uniform else start_B[:, None],
            plan_3,
        )


class KVCache:
    """Key/value buffers for the layers of one model (or one pipeline stage)."""

    def __init__(
        self,
        layer_ids: Iterable[int | str],
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        window: int | None = None,
    ) -> None:
        if batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(
                f"KVCache: batch_size={batch_size} and max_seq_len={max_seq_len} must be positive"
            )
        if window is not None and window <= 0:
            raise ValueError(f"KVCache: window={window} must be positive (or None)")
        # A sliding window shorter than the sequence makes each row a ring of `window` slots.
        slots = max_seq_len if window is None else min(window, max_seq_len)
        # Head-major memory ([B, K, max_S, D]) behind the [B, max_S, K, D] shape: attention then
        # reads each head's keys as one contiguous run, not rows interleaving every head (~30%
        # faster one-query attention over 8 cached rows on CPU).
        shape = (batch_size, num_kv_heads, slots, head_dim)
        self.k_BSKD = {
            str(i): torch.zeros(shape, dtype=dtype, device=device).transpose(1, 2)
            for i in layer_ids
        }
        self.v_BSKD = {key: torch.zeros_like(buf) for key, buf in self.k_BSKD.items()}
        self.key_mask_BS = torch.zeros(batch_size, slots, dtype=torch.bool, device=device)
        self.lengths_B = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        batch_size: int,
        max_seq_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache sized for `model` (a CausalLM or pipeline stage), on its parameters' device;
        a sliding-window model gets rings of its window."""
        config = model.config
        param = next(model.parameters())
        return cls(
            model.layers.keys(),
            batch_size,
            max_seq_len or config.max_position_embeddings,
            config.kv_heads,
            config.head_dim,
            dtype=dtype or param.dtype,
            device=param.device,
            window=config.sliding_window,
        )

    @property
    def slots(self) -> int:
        """Key/value slots per row: max_seq_len, or the window when rows are rings."""
        return self.key_mask_BS.shape[1]

    @property
    def is_ring(self) -> bool:
        """Rows are sliding-window rings (fewer slots than positions)."""
        return self.slots < self.max_seq_len

    def reset(self) -> None:
        """Forget every row (buffers stay allocated)."""
        self.lengths_B.zero_()
        self.key_mask_BS.zero_()

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows [start, stop) sharing this one's memory (writes and lengths)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(
                f"KVCache.rows({start}, {stop}): need 0 <= start < stop <= batch {self.batch_size}"
            )
        view = KVCache.__new__(KVCache)
        view.k_BSKD = {key: buf[start:stop] for key, buf in self.k_BSKD.items()}
        view.v_BSKD = {key: buf[start:stop] for key, buf in self.v_BSKD.items()}
        view.key_mask_BS = self.key_mask_BS[start:stop]
        view.lengths_B = self.lengths_B[start:stop]
        view.batch_size = stop - start
        view.max_seq_len = self.max_seq_len
        return view

    def reset_rows(self, rows_B: torch.Tensor | list[int]) -> None:
        """Empty some rows so new sequences can take their slots (continuous batching)."""
        rows = torch.as_tensor(rows_B, dtype=torch.long, device=self.lengths_B.device)
        self.lengths_B[rows] = 0
        self.key_mask_BS[rows] = False

    def reorder(self, index_B: torch.Tensor) -> None:
        """Keep rows `index_B` in that order (beam search); the batch size stays the same.

        The buffers are replaced, so row views taken earlier no longer alias this cache.
        """
        for store in (self.k_BSKD, self.v_BSKD):
            for key, buf in store.items():
                store[key] = buf.transpose(1, 2).index_select(0, index_B).transpose(1, 2)
        self.key_mask_BS = self.key_mask_BS.index_select(0, index_B)
        self.lengths_B = self.lengths_B.index_select(0, index_B)

    def begin(self, new_tokens: int, key_padding_mask_BS: torch.Tensor | None) -> CacheStep:
        """Plan a forward of `new_tokens` per row; `key_padding_mask_BS` covers only them."""
        start_B = self.lengths_B.clone()
        # One host read per step; every layer then writes with Python ints or a ready index.
        lengths = start_B.tolist()
        key_len = max(lengths) + new_tokens
        if key_len > self.max_seq_len:
            raise ValueError(
                f"KVCache: {new_tokens} new token(s) would need {key_len} slots but the cache holds "
                f"{self.max_seq_len}; allocate a longer cache (max_seq_len)"
            )
        slots = self.slots
        ring = self.is_ring and (new_tokens == 1 or key_len > slots)
        uniform = min(lengths) == lengths[0] == max(lengths)
        if not uniform and new_tokens > 1:
            raise ValueError(
                "KVCache: rows have different lengths, so a step may append only one token per row "
                f"(got {new_tokens}); prefill rows of unequal length separately or left-pad them"
            )
        if key_padding_mask_BS is not None and tuple(key_padding_mask_BS.shape) != (
            self.batch_size,
            new_tokens,
        ):
            raise ValueError(
                f"KVCache: key_padding_mask_BS has shape {tuple(key_padding_mask_BS.shape)}, "
                f"expected [batch={self.batch_size}, new_tokens={new_tokens}]"
            )
        new_mask_BS = (
            torch.ones(self.batch_size, new_tokens, dtype=torch.bool, device=start_B.device)
            if key_padding_mask_BS is None
            else key_padding_mask_BS.to(torch.bool)
        )
        if ring and new_tokens > 1:
            plan = RingPrefill.plan(lengths[0], new_tokens, slots, self.key_mask_BS, new_mask_BS)
            mask_BW = plan.ring_mask(self.key_mask_BS, new_mask_BS)
            return CacheStep(
                start_B,
                new_tokens,
                slots,
                plan.past_slots_P.numel(),
                None if bool(mask_BW.all()) else mask_BW,
                None,
                ring_prefill=plan,
            )
        if ring:
            # One token per row at slot length mod W, over the key its query no longer sees.
            key_len = min(key_len, slots)
            lengths = [n % slots for n in lengths]
        q_offset = key_len - new_tokens
        step = CacheStep(
            start_B,
            new_tokens,
            key_len,
            q_offset,
            None,
            lengths[0] if uniform else None,
            None if uniform else start_B[:, None] % slots,
            torch.tensor([lengths[0] if uniform else -1, key_len, q_offset]),
            ring,
        )
        mask_BS = self.key_mask_BS[:, :key_len].clone()
        # Slots past a shorter row's end were never written, so its stored mask is already False.
        _scatter(mask_BS, new_mask_BS, step)
        step.key_mask_BS = None if bool(mask_BS.all()) else mask_BS
        return step

    def write(
        self, layer_id: int | str, step: CacheStep, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for one layer; return every key/value its queries read
        (a ring's multi-token step reads and writes in `attend` only)."""
        assert step.ring_prefill is None
        key = str(layer_id)
        return _store(self.k_BSKD[key], self.v_BSKD[key], step, k_BSKD, v_BSKD)

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
        """Store this step's keys/values for one layer, then attend from this step's queries over
        every key they may see (cached and new, causal among the new, within the last `window`
        positions with a sliding window); out [B, S, H, D]. A cache of sliding-window rings
        (`is_ring`) holds only the last `window` positions of each row (`models/kv_ring.py`).

        Under torch.compile this is one opaque op, `meshline::kv_cache_attend`: the slots written
        and the keys read change every step, so a graph that held them would be rebuilt every
        step, while the op keeps the graph's shapes fixed (q in, out of q's shape).
        """
        key = str(layer_id)
        k_cache, v_cache = self.k_BSKD[key], self.v_BSKD[key]
        if step.ring_prefill is not None:
            assert window == self.slots and alibi_slopes_H is None  # rings: RoPE windows only
            return step.ring_prefill.attend(k_cache, v_cache, q_BSHD, k_BSKD, v_BSKD, window)
        if step.ring:
            window = None  # every key left in the ring is inside the window
        if torch.compiler.is_compiling():
            assert step.plan_3 is not None  # set by begin()
            return kv_cache_attend(
                q_BSHD,
                k_BSKD,
                v_BSKD,
                k_cache,
                v_cache,
                step.start_B,
                step.plan_3,
                step.key_mask_BS,
                alibi_slopes_H,
                window,
            )
        return _store_and_attend(
            k_cache, v_cache, step, q_BSHD, k_BSKD, v_BSKD, alibi_slopes_H, window
        )

    def commit(self, step: CacheStep) -> None:
        """Advance every row by the step's tokens (call once after all layers wrote)."""
        if step.key_mask_BS is None:
            self.key_mask_BS[:, : step.key_len] = True
        else:
            self.key_mask_BS[:, : step.key_len] = step.key_mask_BS
        self.lengths_B += step.new_tokens  # in place, so row views see it


def _scatter(dest_BS: torch.Tensor, new_BS: torch.Tensor, step: CacheStep) -> None:
    """dest[b, start[b] + t] = new[b, t] for every row b and step token t."""
    if step.start is not None:
        dest_BS[:, step.start : step.start + new_BS.shape[1]] = new_BS
        return
    assert step.slots_B is not None  # rows differ: one token each
    dest_BS.scatter_(1, _expand_index(step.slots_B, new_BS), new_BS.to(dest_BS.dtype))


def _store(
    k_cache_BSKD: torch.Tensor,
    v_cache_BSKD: torch.Tensor,
    step: CacheStep,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new keys/values at the step's slots; the first key_len slots of each."""
    _scatter(k_cache_BSKD, k_BSKD, step)
    _scatter(v_cache_BSKD, v_BSKD, step)
    return k_cache_BSKD[:, : step.key_len], v_cache_BSKD[:, : step.key_len]


def _store_and_attend(
    k_cache_BSKD: torch.Tensor,
    v_cache_BSKD: torch.Tensor,
    step: CacheStep,
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    alibi_slopes_H: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    k_all, v_all = _store(k_cache_BSKD, v_cache_BSKD, step, k_BSKD, v_BSKD)
    key_mask_BS = step.key_mask_BS
    if window is not None and step.start is None:
        # Rows of unequal length (one new token each, at slot start_B[b]): the window is per row,
        # so it becomes part of the key mask rather than a shared query offset.
        k_pos_S = torch.arange(step.key_len, device=step.start_B.device)
        near_BS = k_pos_S[None, :] > step.start_B[:, None] - window
        key_mask_BS = near_BS if key_mask_BS is None else key_mask_BS & near_BS
        window = None
    out_BSHD = attention(
        q_BSHD,
        k_all,
        v_all,
        causal=True,
        alibi_slopes_H=alibi_slopes_H,
        key_padding_mask_BS=key_mask_BS,
        q_offset=step.q_offset,
        window=window,
    )
    assert isinstance(out_BSHD, torch.Tensor)  # no return_lse: a single tensor
    return out_BSHD


def _kv_cache_attend(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    k_cache_BSKD: torch.Tensor,
    v_cache_BSKD: torch.Tensor,
    start_B: torch.Tensor,
    plan_3: torch.Tensor,
    key_mask_BS: torch.Tensor | None,
    alibi_slopes_H: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    step = CacheStep.from_plan(plan_3, start_B, k_BSKD.shape[1], key_mask_BS)
    if step.slots_B is not None:
        step.slots_B = step.slots_B % k_cache_BSKD.shape[1]  # a ring's slots: positions mod W
    out_BSHD = _store_and_attend(
        k_cache_BSKD, v_cache_BSKD, step, q_BSHD, k_BSKD, v_BSKD, alibi_slopes_H, window
    )
    return out_BSHD.contiguous()  # the layout the fake below promises


def _kv_cache_attend_fake(q_BSHD: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q_BSHD, memory_format=torch.contiguous_format)


# A plain library op rather than torch.library.custom_op: the latter's Python wrapping costs
# more per call than the small decode attention itself.
_LIB = torch.library.Library("meshline", "FRAGMENT")
_LIB.define(
    "kv_cache_attend(Tensor q_BSHD, Tensor k_BSKD, Tensor v_BSKD, Tensor(a!) k_cache_BSKD, "
    "Tensor(b!) v_cache_BSKD, Tensor start_B, Tensor plan_3, Tensor? key_mask_BS, "
    "Tensor? alibi_slopes_H, int? window=None) -> Tensor"
)
_LIB.impl("kv_cache_attend", _kv_cache_attend, "CompositeExplicitAutograd")
torch.library.register_fake("meshline::kv_cache_attend", _kv_cache_attend_fake, lib=_LIB)
kv_cache_attend = torch.ops.meshline.kv_cache_attend
"""`KVCache.attend` on one layer's cache buffers, for compiled forwards (see there)."""


def _expand_index(slots_B1: torch.Tensor, new_BT: torch.Tensor) -> torch.Tensor:
    """Slot indices [B, 1] broadcast over the trailing dims of a [B, 1, ...] update (scatter_)."""
    return slots_B1.view(*slots_B1.shape, *([1] * (new_BT.dim() - 2))).expand_as(new_BT)
