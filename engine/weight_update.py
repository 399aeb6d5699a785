"""Versioned weight updates of a served model: named raw tensors staged, checked, then swapped.

A trainer pushes its policy to rollout servers (issue #41). An update arrives as named tensors
in raw little-endian bytes, never pickles. `WeightUpdate` checks each tensor as it starts (the
name is a parameter of the served model, sent at most once; dtype and shape are the served
ones), so a bad update is refused before its bytes are read, and copies the bytes into staging
buffers of exactly the parameter's size, so an update can hold at most the model's own bytes.
Only a complete update is applied: `apply()` copies every staged tensor into the parameter in
place, on the engine thread between two steps. In place keeps every view the decode paths took
of the weights (the lean and C steps, CUDA graphs, huge-page and column-major layouts) valid;
the oneDNN-packed layouts hold a transformed copy and are refused by `updatable_parameters`.

Requests in flight at the swap continue with the new weights (their cached keys and values
were computed with the old ones); a trainer that needs on-policy rollouts pushes between
rollout phases, as vLLM-based RL trainers do.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from kernels.packed_linear import PackedLinear

MAX_NAME_CHARS = 1024
"""Longer tensor names are refused without a look-up (and quoted cut short)."""


class WeightUpdateError(ValueError):
    """An update the served model cannot take; `field` names the tensor or setting at fault."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class StaleVersion(WeightUpdateError):
    """The update's version is not newer than the one being served."""


def updatable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The served model's parameters by name (tied ones once, under their first name).

    ValueError when a layer keeps its weights in a packed copy that an in-place update would
    not reach (`--cpu-linear packed` or `packed+gemv`)."""
    packed = [name for name, module in model.named_modules() if isinstance(module, PackedLinear)]
    if packed:
        raise ValueError(
            f"weight updates need dense weights, and {len(packed)} layers (e.g. {packed[0]!r}) "
            "are oneDNN-packed; serve with --cpu-linear dense or colmajor"
        )
    return {name: param for name, param in model.named_parameters()}


@dataclass(frozen=True)
class AppliedUpdate:
    """What an applied update replaced."""

    version: int
    """The version now served."""
    num_tensors: int
    """Tensors replaced."""
    num_bytes: int
    """Bytes replaced."""


class WeightVersion:
    """The version of the weights a model serves, and a lock so that one update runs at a time."""

    def __init__(self, parameters: dict[str, torch.Tensor]) -> None:
        if sys.byteorder != "little":
            raise ValueError("weight updates are little-endian bytes; this host is big-endian")
        self.parameters = parameters
        """The served parameters by name (`updatable_parameters`)."""
        self.version = 0
        """0: the weights as loaded."""
        self.busy = threading.Lock()
        """Held while an update is staged and applied."""

    def check_newer(self, version: int) -> None:
        """StaleVersion unless `version` is newer than the one served."""
        if version <= self.version:
            raise StaleVersion(
                "version",
                f"{version} is not newer than the version being served ({self.version}); "
                "send a greater version",
            )


class WeightUpdate:
    """One update being received: tensors are started, filled chunk by chunk, then applied."""

    def __init__(
        self, served: WeightVersion, version: int, *, full: bool, num_tensors: int
    ) -> None:
        served.check_newer(version)
        total = len(served.parameters)
        if full and num_tensors != total:
            raise WeightUpdateError(
                "num_tensors",
                f"a full update carries every parameter of the served model ({total}), "
                f"got {num_tensors}; send them all or make it a partial update",
            )
        if not 1 <= num_tensors <= total:
            raise WeightUpdateError(
                "num_tensors", f"must be in [1, {total}] (the served parameters), got {num_tensors}"
            )
        self.served = served
        self.version = version
        self.num_tensors = num_tensors
        self.staged: dict[str, torch.Tensor] = {}
        """Received tensors' staging buffers (flat bytes), by name."""
        self._current: str | None = None
        self._filled = 0

    @property
    def num_bytes(self) -> int:
        """Bytes staged so far."""
        return sum(buffer.numel() for buffer in self.staged.values())

    def start_tensor(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        """Begin tensor `name`; WeightUpdateError naming it unless it matches the served one."""
        self._finish_current()
        if len(name) > MAX_NAME_CHARS:
            raise WeightUpdateError(
                f"tensor {name[:64]!r}...",
                f"a name of {len(name)} characters; no parameter has one",
            )
        target = self.served.parameters.get(name)
        if target is None:
            raise WeightUpdateError(
                f"tensor {name!r}", "is not a parameter of the served model (GetModelInfo names it)"
            )
        if name in self.staged:
            raise WeightUpdateError(f"tensor {name!r}", "is sent twice; send each tensor once")
        if len(self.staged) >= self.num_tensors:
            raise WeightUpdateError(
                f"tensor {name!r}", f"is past the {self.num_tensors} tensors the header announced"
            )
        served_dtype = str(target.dtype).removeprefix("torch.")
        if dtype != served_dtype:
            raise WeightUpdateError(
                f"tensor {name!r}",
                f"dtype {dtype!r} differs from the served {served_dtype!r}; cast it before sending",
            )
        if tuple(shape) != tuple(target.shape):
            raise WeightUpdateError(
                f"tensor {name!r}",
                f"shape {_shape(shape)} differs from the served {list(target.shape)}",
            )
        self.staged[name] = torch.empty(target.numel() * target.element_size(), dtype=torch.uint8)
        self._current, self._filled = name, 0

    def add_bytes(self, name: str, offset: int, data: bytes) -> None:
        """Stage the next `data` of tensor `name` at byte `offset` (chunks in order)."""
        if name != self._current:
            raise WeightUpdateError(
                f"tensor {name!r}",
                "a chunk of a tensor that was not started (its first chunk has offset 0, dtype "
                "and shape) or of one already finished; send each tensor's chunks back to back",
            )
        buffer = self.staged[name]
        if offset != self._filled:
            raise WeightUpdateError(
                f"tensor {name!r}",
                f"chunk at byte {offset}, expected {self._filled}; send the chunks in order",
            )
        end = offset + len(data)
        if end > buffer.numel():
            raise WeightUpdateError(
                f"tensor {name!r}",
                f"{end} bytes sent, more than its {buffer.numel()} (numel x element size)",
            )
        if data:
            with warnings.catch_warnings():  # read only: torch warns that bytes are immutable
                warnings.simplefilter("ignore", UserWarning)
                chunk = torch.frombuffer(data, dtype=torch.uint8)
            buffer[offset:end] = chunk
        self._filled = end

    def finish(self) -> None:
        """WeightUpdateError unless every announced tensor arrived complete."""
        self._finish_current()
        if len(self.staged) != self.num_tensors:
            missing = [n for n in self.served.parameters if n not in self.staged]
            raise WeightUpdateError(
                "num_tensors",
                f"the header announced {self.num_tensors} tensors and {len(self.staged)} came "
                f"(not sent: {missing[:3]}{'...' if len(missing) > 3 else ''})",
            )
        self.served.check_newer(self.version)

    def apply(self) -> AppliedUpdate:
        """Copy every staged tensor into its parameter (call on the engine thread, between
        steps, after `finish`); the served version becomes this update's."""
        self.served.check_newer(self.version)
        with torch.no_grad():
            for name, buffer in self.staged.items():
                target = self.served.parameters[name]
                source = buffer.view(target.dtype).view(target.shape)
                target.copy_(source.to(target.device, non_blocking=False))
        self.served.version = self.version
        applied = AppliedUpdate(self.version, len(self.staged), self.num_bytes)
        self.staged = {}
        return applied

    def _finish_current(self) -> None:
        name = self._current
        if name is None:
            return
        size = self.staged[name].numel()
        if self._filled != size:
            raise WeightUpdateError(
                f"tensor {name!r}", f"ended after {self._filled} of its {size} bytes"
            )
        self._current = None


def _shape(shape: tuple[int, ...]) -> str:
    """`shape` for a message, cut short when a hostile one is long."""
    return str(list(shape)) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...]"
