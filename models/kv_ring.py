"""Sliding-window KV cache rows as rings: memory bounded by the window, not the sequence.

Shapes: B batch, S new tokens, W window (= ring slots), P past keys read, K kv heads, D head dim.

A model whose attention sees only its last W positions (Mistral's sliding window) needs no key
older than W - 1 positions back, so `KVCache` gives it W slots per row instead of max_seq_len and
stores position p at slot p mod W. Two kinds of step then read the ring:

- one token per row (decode, rows of equal or unequal length): the new key is written first, at
  slot `length mod W`, over the key W positions back — the one its query no longer sees. Every
  slot still holding a key is inside the window, so attention reads the whole ring with the key
  mask only, in slot order (a single query's softmax does not depend on the keys' order).
- several tokens (a prefill or a chunk, rows of equal length) that reach past the ring: the
  queries need keys in position order, with the window applied among them. `RingPrefill` reads
  the last min(length, W - 1) keys out of the ring in position order, attends over those plus
  the new keys, and only then writes the last min(S, W) new keys into their slots.

A multi-token step that stays within the first W positions uses the plain path (slot = position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import attention


@dataclass
class RingPrefill:
    """How a multi-token step reads and writes a ring whose rows all hold `length` positions."""

    past_slots_P: torch.Tensor
    """Slots of the last P cached positions, oldest first (P = min(length, W - 1))."""
    mask_BT: torch.Tensor | None
    """Visible keys over past + new (True = real token); None when all are."""
    write_from: int
    """Index of the first new token that is kept (the last min(S, W) are)."""
    write_slots_N: torch.Tensor
    """Slot of each kept new token."""

    @classmethod
    def plan(
        cls,
        length: int,
        new_tokens: int,
        slots: int,
        stored_mask_BW: torch.Tensor,
        new_mask_BS: torch.Tensor,
    ) -> RingPrefill:
        """The reads and writes of `new_tokens` appended to rows of `length` positions."""
        device = stored_mask_BW.device
        past = min(length, slots - 1)
        past_slots_P = torch.arange(length - past, length, device=device) % slots
        kept = min(new_tokens, slots)
        end = length + new_tokens
        write_slots_N = torch.arange(end - kept, end, device=device) % slots
        mask_BT = torch.cat([stored_mask_BW[:, past_slots_P], new_mask_BS], dim=1)
        return cls(
            past_slots_P,
            None if bool(mask_BT.all()) else mask_BT,
            new_tokens - kept,
            write_slots_N,
        )

    def ring_mask(self, stored_mask_BW: torch.Tensor, new_mask_BS: torch.Tensor) -> torch.Tensor:
        """The ring's key mask after this step's writes."""
        mask_BW = stored_mask_BW.clone()
        mask_BW[:, self.write_slots_N] = new_mask_BS[:, self.write_from :]
        return mask_BW

    def attend(
        self,
        k_ring_BWKD: torch.Tensor,
        v_ring_BWKD: torch.Tensor,
        q_BSHD: torch.Tensor,
        k_BSKD: torch.Tensor,
        v_BSKD: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        """Attention of the new queries over the past keys and the new ones (causal, windowed),
        then the new keys' write into the ring; out [B, S, H, D]."""
        k_all = torch.cat([k_ring_BWKD[:, self.past_slots_P], k_BSKD], dim=1)
        v_all = torch.cat([v_ring_BWKD[:, self.past_slots_P], v_BSKD], dim=1)
        out_BSHD = attention(
            q_BSHD,
            k_all,
            v_all,
            causal=True,
            key_padding_mask_BS=self.mask_BT,
            q_offset=self.past_slots_P.numel(),
            window=window,
        )
        assert isinstance(out_BSHD, torch.Tensor)  # no return_lse: a single tensor
        k_ring_BWKD[:, self.write_slots_N] = k_BSKD[:, self.write_from :]
        v_ring_BWKD[:, self.write_slots_N] = v_BSKD[:, self.write_from :]
        return out_BSHD
