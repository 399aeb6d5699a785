"""A last-gasp save on SIGTERM: the handler only raises a flag; the loop saves at a step boundary.

Saving inside the signal handler would interrupt a collective half-way; instead the loop asks
`LastGasp.agreed(group)` once per step, which all-reduces the flag so every rank saves at the same
step even when the signal reached only some of them (Kubernetes signals every pod, torchrun
forwards to every worker, but not at the same instant).

SIGTERM asks for a save before exiting (preemption, Kubernetes, StopTraining by default);
SIGUSR2 asks to stop without one (StopTraining with save_checkpoint=false). When ranks disagree,
the save wins: a rank that was told to save never loses its state to a neighbour's no-save stop.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


SAVE_SIGNAL = signal.SIGTERM
NO_SAVE_SIGNAL = signal.SIGUSR2
# What a rank votes in `agreed`'s MAX all-reduce: the larger the vote, the stronger the request.
_VOTES: dict[int, int] = {NO_SAVE_SIGNAL: 1, SAVE_SIGNAL: 2}


class LastGasp:
    """Installs a handler that records termination requests; `install()`/`uninstall()` bracket use."""

    def __init__(self, signals: tuple[int, ...] = (SAVE_SIGNAL, NO_SAVE_SIGNAL)):
        self.signals = signals
        self.received: int | None = None
        self.save_agreed = True
        """After `agreed()` returned True: whether the stop asked for a checkpoint first."""
        self._previous: dict[int, Any] = {}

    def install(self) -> LastGasp:
        """Start recording the signals (main thread only, as Python requires)."""
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.received is None or _vote(signum) > _vote(self.received):
            self.received = signum
        log.warning(
            "received %s: stopping at the next step boundary%s",
            signal.Signals(signum).name,
            "" if signum == NO_SAVE_SIGNAL else " after saving a checkpoint",
        )

    @property
    def requested(self) -> bool:
        """Whether this process received one of the signals."""
        return self.received is not None

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank received a signal (a MAX all-reduce; all ranks must call it).

        Also sets `save_agreed`: False only when no rank was asked to save.
        """
        vote = _vote(self.received) if self.received is not None else 0
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([vote])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            vote = int(flag.item())
        if vote:
            self.save_agreed = vote != _VOTES[NO_SAVE_SIGNAL]
        return vote > 0


def _vote(signum: int) -> int:
    """A signal's strength; signals outside the table count as save requests."""
    return _VOTES.get(signum, _VOTES[SAVE_SIGNAL])
