"""`torch.save` files from untrusted checkpoints, loaded weights-only after a static check.

`torch.load(weights_only=True)` refuses a global outside its allow-list only when it reaches it,
after building whatever came before. Every `.pt`/`.bin` file a source reads goes through
`load_weights_only` instead: the file's pickle is first disassembled without building anything
(`torch.serialization.get_unsafe_globals_in_checkpoint`, which sees every global the weights-only
unpickler could resolve; it supports no other way of naming one), and a file naming anything
outside torch's weights-only set plus the caller's exact allow-list is refused, naming the file
and the globals, before a single object exists. Only then is it loaded, weights-only and
memory-mapped.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class RefusedGlobals(ValueError):
    """A checkpoint file names globals outside the allow-list."""


def _names(allowed: Sequence[Any]) -> list[str]:
    return [item[1] if isinstance(item, tuple) else item.__name__ for item in allowed]


def load_weights_only(path: Path, allowed: Sequence[Any], hint: str, mmap: bool = True) -> Any:
    """The object in `path`, which may hold tensors, plain values and the types in `allowed`
    (as for `torch.serialization.safe_globals`). `hint` tells the user what to do with a trusted
    file that holds more; refusals raise RefusedGlobals, unreadable files ValueError."""
    with torch.serialization.safe_globals(list(allowed)):
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except (ValueError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"{path} is not a readable torch checkpoint ({first}); truncated?"
            ) from exc
        if unsafe:
            raise RefusedGlobals(
                f"{path}: refused to load; it holds {', '.join(unsafe)}, which is outside the "
                f"allow-list of {_names(allowed)}, tensors and plain values; nothing in it was "
                f"built ({hint})"
            )
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RefusedGlobals(f"{path}: refused to load ({first}; {hint})") from exc
        except (RuntimeError, EOFError, OSError) as exc:
            raise ValueError(
                f"{path} is not a readable torch checkpoint ({exc}); truncated?"
            ) from exc
