"""Blend order for three or more datasets: guess a block of steps, verify it exactly with numpy.

Megatron's greedy (serve the dataset furthest behind `weight * step - served`, the first one on
ties) is a smooth weighted round robin: each step depends on every earlier one, and unlike two
datasets (`blended._blend_two`) it has no closed form. But for the weights people write
(`--data-path 0.3 a 0.2 b 0.5 c`) the order repeats with a short period P (every `w_i * P`
nearly an integer), so the next block is guessed as a copy of the last P steps and then checked
in one vectorised pass: given the guessed prefix, every step's greedy choice is recomputed with
the loop's own double arithmetic. If the guess agrees at every step, by induction it *is* the
greedy's order; at the first disagreement the recomputed choice is exact (its prefix is), so
it is kept and the guess resumes after it. Floating-point ties at period boundaries show up as
two nearby steps in swapped order; swapping them back and re-checking repairs most of them without
giving up the block. Weights without a short period, or guesses that keep failing, finish with
the exact step-by-step loop from wherever the vectorised part stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_PERIOD = 1 << 14
"""Longest period tried (the first P + 2 steps run in the loop; P <= size / 8)."""
PERIOD_TOLERANCE = 1e-6
"""A period P needs |w_i * P - round(w_i * P)| below this for every weight."""
_MIN_BLOCK, _MAX_BLOCK = 1024, 1 << 16
_REPAIRS = 4  # swap-repair rounds per block
_SWAP_REACH = 8  # how far ahead a misplaced choice is looked for
_MAX_FIXES = 256  # swaps tried per repair round
_MIN_STEPS_PER_CHECK = 512  # below this (on average, after a few blocks) the loop is cheaper


def blend_steps(weights: Sequence[float], served: list[int], picks: np.ndarray, start: int) -> None:
    """The reference greedy for steps `start..len(picks)`, continuing from `served` (updated)."""
    others = range(1, len(weights))
    first = weights[0]
    out = [0] * (picks.size - start)
    for pos, step in enumerate(range(start, picks.size)):
        scale = float(step) if step > 1 else 1.0
        best, best_error = 0, first * scale - served[0]
        for i in others:
            error = weights[i] * scale - served[i]
            if error > best_error:
                best, best_error = i, error
        out[pos] = best
        served[best] += 1
    picks[start:] = out


def find_period(weights: Sequence[float], limit: int) -> int | None:
    """Smallest P <= limit with every `weight * P` within PERIOD_TOLERANCE of an integer."""
    w = np.asarray(weights, dtype=np.float64)[:, None]
    low = 1
    while low <= limit:  # short periods first: the usual weights need no large table
        high = min(limit, 4 * low + 60)
        products = w * np.arange(low, high + 1, dtype=np.float64)
        distance = np.abs(products - np.round(products)).max(axis=0)
        found = np.flatnonzero(distance <= PERIOD_TOLERANCE)
        if found.size:
            return low + int(found[0])
        low = high + 1
    return None


def greedy_choices(
    weights: np.ndarray,
    guess: np.ndarray,
    served: np.ndarray,
    start: int,
    targets: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The greedy's choice at each step `start + j`, given that `guess[:j]` was served before.

    `targets[i]` (optional, reused across calls on one block) is `weights[i] * scale` per step.
    """
    if targets is None:
        targets = weight_targets(weights, start, guess.size)
    choice = np.zeros(guess.size, dtype=np.int64)
    best = None
    for i, target in enumerate(targets):
        hit = guess == i
        before = np.cumsum(hit, dtype=np.int64)
        before -= hit
        before += int(served[i])
        error = target - before  # the loop's arithmetic: the double product minus the count
        if best is None:
            best = error
        else:
            choice[error > best] = i  # strictly greater: the first dataset wins ties
            np.maximum(best, error, out=best)
    return choice


def weight_targets(weights: np.ndarray, start: int, count: int) -> list[np.ndarray]:
    """`weight * max(step, 1)` (doubles) for each dataset and steps `start..start+count`."""
    scale = np.maximum(np.arange(start, start + count, dtype=np.float64), 1.0)
    return [weight * scale for weight in weights.tolist()]


def _repair(guess: np.ndarray, truth: np.ndarray, wrong: np.ndarray) -> bool:
    """Swap each wrong guess with the nearby step that holds the greedy's choice (False: none).

    Rounding at near-ties reorders two steps a few apart; the choices after such a pair are
    computed from the right counts again, so many pairs can be fixed in one pass.
    """
    fixed, done = False, -1
    for m in wrong[:_MAX_FIXES].tolist():
        if m <= done:
            continue
        window = guess[m + 1 : m + 1 + _SWAP_REACH]
        found = np.flatnonzero(window == truth[m])
        if found.size == 0:
            break  # not a local reordering: keep the exact prefix only
        k = m + 1 + int(found[0])
        guess[m], guess[k] = guess[k], guess[m]
        fixed, done = True, k
    return fixed


def _repeat(pattern: np.ndarray, count: int) -> np.ndarray:
    """`pattern` repeated to `count` entries (log-many copies)."""
    out = np.empty(count, dtype=pattern.dtype)
    filled = min(pattern.size, count)
    out[:filled] = pattern[:filled]
    while filled < count:
        more = min(filled, count - filled)
        out[filled : filled + more] = out[:more]
        filled += more
    return out


def blend_many(weights: Sequence[float], size: int) -> np.ndarray:
    """Dataset id of each of `size` blended steps, exactly the greedy's (see the module doc)."""
    listed = [float(w) for w in weights]
    w = np.asarray(listed, dtype=np.float64)
    picks = np.zeros(size, dtype=np.int64)
    period = find_period(listed, min(MAX_PERIOD, size // 8))
    if period is None:
        blend_steps(listed, [0] * len(listed), picks, 0)
        return picks
    served_list = [0] * len(listed)
    warm = period + 2  # steps 0 and 1 share scale 1: guesses start after them
    blend_steps(listed, served_list, picks[:warm], 0)
    served = np.asarray(served_list, dtype=np.int64)
    step, block, checks = warm, _MIN_BLOCK, 0
    while step < size:
        block = min(block, size - step)
        guess = _repeat(picks[step - period : step], block)
        targets = weight_targets(w, step, block)
        for repair in range(_REPAIRS + 1):
            truth = greedy_choices(w, guess, served, step, targets)
            checks += 1
            wrong = np.flatnonzero(truth != guess)
            if wrong.size == 0 or repair == _REPAIRS or not _repair(guess, truth, wrong):
                break  # `truth` and `wrong` describe the current guess
        accepted = int(wrong[0]) if wrong.size else block
        if accepted < block:  # the first wrong guess: the greedy's choice there is exact
            guess[accepted] = truth[accepted]
            accepted += 1
        picks[step : step + accepted] = guess[:accepted]
        served += np.bincount(guess[:accepted], minlength=w.size)
        step += accepted
        block = min(2 * block, _MAX_BLOCK) if accepted == block else max(_MIN_BLOCK, 2 * accepted)
        if checks >= 8 and (step - warm) < _MIN_STEPS_PER_CHECK * checks:
            break
    if step < size:  # guesses kept failing: the loop finishes from the exact state
        blend_steps(listed, served.tolist(), picks, step)
    return picks


def sample_ids(picks: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each step, how many samples of its dataset were served before it."""
    ids = np.empty(picks.size, dtype=np.int64)
    for i in range(num_datasets):
        mine = picks == i
        ids[mine] = np.arange(int(np.count_nonzero(mine)), dtype=np.int64)
    return ids
