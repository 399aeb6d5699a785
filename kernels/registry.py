"""Op registry: each op is a plain-PyTorch reference plus backends keyed by device type.

The pattern follows vLLM's CustomOp (forward_native / forward_cuda / forward_npu) but as data:
an `Op` holds its reference and an ordered list of `Backend`s, each naming the device types it
serves. The default backend for an op is chosen once per process from
`kernels.device.current().type` (the first registered backend that serves that device and whose
import succeeds). Device backends live in `kernels/npu/` and `kernels/cuda/` and are named by
"module:attribute" strings so that torch_npu / flash-attn are imported only when selected.

`MESHLINE_KERNELS` overrides the choice for debugging: `reference` forces every op to its
reference, and `attention=blockwise,rms_norm=reference` picks per op.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import device

log = logging.getLogger(__name__)

KERNELS_ENV = "MESHLINE_KERNELS"
ALL_DEVICES = ("cpu", "cuda", "npu")
REFERENCE = "reference"


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: a callable or a lazy "module:attribute" path."""

    name: str
    devices: tuple[str, ...]
    target: Callable[..., Any] | str
    preferred: bool = True
    """False: selectable with `backend=` or MESHLINE_KERNELS, but the reference stays the
    default (a backend measured slower than the reference on its device)."""

    def load(self) -> Callable[..., Any]:
        """The callable, importing its module on first use (then cached, so a graph that
        torch.compile traces through a loaded backend reads a dict, not an import)."""
        if callable(self.target):
            return self.target
        loaded = _LOADED.get(self.target)
        if loaded is None:
            module_name, _, attr = self.target.partition(":")
            loaded = _LOADED[self.target] = getattr(importlib.import_module(module_name), attr)
        return loaded

    def importable(self) -> bool:
        """Whether `load` succeeds here (flash-attn / torch_npu may be missing)."""
        try:
            self.load()
        except ImportError:
            return False
        return True


# "module:attribute" -> the loaded callable.
_LOADED: dict[str, Callable[..., Any]] = {}


def forget_loaded() -> None:
    """Drop the loaded backend callables, so the next use imports their modules afresh (tests
    that swap a stand-in torch_npu in and out)."""
    _LOADED.clear()


@dataclass
class Op:
    """A kernel: its reference (the specification) and device backends in preference order."""

    name: str
    reference: Callable[..., Any]
    backends: list[Backend] = field(default_factory=list)

    def register(
        self,
        name: str,
        devices: tuple[str, ...],
        target: Callable[..., Any] | str,
        *,
        preferred: bool = True,
    ) -> None:
        """Add a backend; earlier registrations are preferred for a device, and a backend
        registered with preferred=False comes after the reference."""
        unknown = [d for d in devices if d not in ALL_DEVICES]
        if unknown:
            raise ValueError(f"backend {name!r} of op {self.name!r}: unknown devices {unknown}")
        if name == REFERENCE or any(b.name == name for b in self.backends):
            raise ValueError(f"op {self.name!r} already has a backend named {name!r}")
        self.backends.append(Backend(name, devices, target, preferred))
        _default_backend_name.cache_clear()

    def names(self) -> list[str]:
        """Every backend name, reference included (the valid `backend=` choices)."""
        return [REFERENCE, *(b.name for b in self.backends)]

    def get(self, name: str) -> Callable[..., Any]:
        """The implementation called `name`; ValueError listing the choices if unknown."""
        if name == REFERENCE:
            return self.reference
        for backend in self.backends:
            if backend.name == name:
                return backend.load()
        raise ValueError(f"op {self.name!r} has no backend {name!r}; choose one of {self.names()}")

    def candidates(self, device_type: str | None = None) -> list[str]:
        """Backend names serving `device_type` (current device if None), preferred first."""
        device_type = device_type or _current_device_type()
        serving = [b for b in self.backends if device_type in b.devices]
        return (
            [b.name for b in serving if b.preferred]
            + [REFERENCE]
            + [b.name for b in serving if not b.preferred]
        )

    def available(self, device_type: str | None = None) -> list[str]:
        """`candidates` whose implementation imports on this machine."""
        names = self.candidates(device_type)
        importable = {b.name for b in self.backends if b.name in names and b.importable()}
        return [name for name in names if name == REFERENCE or name in importable]

    def default(self) -> str:
        """The backend name this process uses when no `backend=` is given (chosen once)."""
        return _backend_for(self.name)

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        return self.get(backend or self.default())(*args, **kwargs)


OPS: dict[str, Op] = {}


def define(name: str, reference: Callable[..., Any]) -> Op:
    """Create and register an op with its reference implementation."""
    if name in OPS:
        raise ValueError(f"kernel op {name!r} is defined twice")
    op = Op(name, reference)
    OPS[name] = op
    return op


def parse_override(value: str | None) -> dict[str, str]:
    """Parse $MESHLINE_KERNELS: "reference" (all ops) or "op=backend,op=backend"."""
    if not value or not value.strip():
        return {}
    value = value.strip()
    if "=" not in value:
        return {"*": value}
    choices: dict[str, str] = {}
    for item in value.split(","):
        op_name, sep, backend_name = item.partition("=")
        if not sep or not op_name.strip() or not backend_name.strip():
            raise ValueError(
                f"{KERNELS_ENV}={value!r}: item {item!r} is not op=backend "
                "(example: attention=blockwise,rms_norm=reference)"
            )
        choices[op_name.strip()] = backend_name.strip()
    return choices


@torch.compiler.assume_constant_result
def _current_device_type() -> str:
    """This process's device type, a constant to torch.compile (no device probing traced)."""
    return device.current().type


def preload() -> None:
    """Choose and import every op's default backend now, eagerly.

    Called before torch.compile wraps the model, so tracing meets only cached choices and loaded
    callables: no import or device probe inside a graph (each would be a graph break).
    """
    done: set[str] = set()
    while len(done) < len(OPS):  # loading a backend module may define more ops
        for name, op in list(OPS.items()):
            if name not in done:
                op.get(op.default())
                done.add(name)


@torch.compiler.assume_constant_result
def _backend_for(op_name: str) -> str:
    """`_default_backend_name`, read by torch.compile as a constant of the graph it builds (the
    choice is made once per process) rather than traced through the device probing."""
    return _default_backend_name(op_name)


@functools.cache
def _default_backend_name(op_name: str) -> str:
    op = OPS[op_name]
    override = parse_override(os.environ.get(KERNELS_ENV))
    wanted = override.get(op_name, override.get("*"))
    if wanted is not None:
        if wanted not in op.names():
            raise ValueError(
                f"{KERNELS_ENV} asks op {op_name!r} for backend {wanted!r}; "
                f"choose one of {op.names()}"
            )
        return wanted
    device_type = device.current().type
    for name in op.candidates(device_type):
        try:
            op.get(name)
        except ImportError as exc:
            log.info(
                "kernel %s: backend %s unavailable on %s (%s)", op_name, name, device_type, exc
            )
            continue
        log.debug("kernel %s: using backend %s on %s", op_name, name, device_type)
        return name
    raise AssertionError("the reference is always a candidate")


def selected() -> dict[str, str]:
    """The backend each defined op uses in this process (for logs and run manifests)."""
    return {name: op.default() for name, op in OPS.items()}
