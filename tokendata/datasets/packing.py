"""First-fit packing of variable-length samples into rows of at most `capacity` tokens."""

from __future__ import annotations

import numpy as np


def first_fit(lengths: np.ndarray, capacity: int, decreasing: bool = True) -> list[list[int]]:
    """Bins of item ids: each item goes into the first bin (in opening order) with room.

    With `decreasing`, items are placed longest first (first-fit decreasing: fewer, fuller bins;
    ties keep id order). Items longer than `capacity` must be truncated by the caller. Runs in
    O(n log n) with a max-tree over the bins' free space.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        raise ValueError(
            f"an item of {int(lengths.max())} tokens exceeds the row capacity {capacity}"
        )
    order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(lengths.size)
    leaves = 1
    while leaves < max(1, lengths.size):
        leaves *= 2
    # tree[1] is the root; leaf b (bin b) lives at tree[leaves + b]; a node holds its subtree's
    # largest free space, so the leftmost bin with room is found by one descent.
    tree = [capacity] * (2 * leaves)
    bins: list[list[int]] = []
    sizes = lengths.tolist()
    for item in order.tolist():
        size = sizes[item]
        node = 1
        while node < leaves:
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        slot = node - leaves
        if slot == len(bins):
            bins.append([])
        bins[slot].append(item)
        tree[node] -= size
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def packing_efficiency(lengths: np.ndarray, bins: list[list[int]], capacity: int) -> float:
    """Fraction of the packed rows' token slots holding real tokens."""
    return float(np.asarray(lengths).sum()) / max(1, len(bins) * capacity)
