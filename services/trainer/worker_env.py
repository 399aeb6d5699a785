"""The environment a training request may set for its workers: an exact allow-list.

A request's `env` never configures the process freely: variables such as `LD_PRELOAD`,
`PYTHONPATH`, `PYTHONSTARTUP`, `PYTHONWARNINGS` or `BROWSER` make Python or the loader run
code of the requester's choosing. Only collective-communication and threading tuning knobs are
accepted, each with a value pattern that admits numbers and short identifiers and nothing that
can name a file, a library, a module or a command. Everything else is refused with
INVALID_ARGUMENT naming the variable. The workers' environment is the operator's (the service
process's) environment plus these validated entries plus what the launcher sets itself.

Left out on purpose (they name files or libraries): NCCL_NET_PLUGIN, NCCL_TOPO_FILE,
NCCL_DEBUG_FILE, NCCL_GRAPH_FILE, HCCL_*_FILE and friends; also every LD_*, PYTHON*, TORCH_*
other than the NCCL error-handling switches below, and the launcher's own variables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_INT = re.compile(r"0|[1-9][0-9]{0,8}")
_SWITCH = re.compile(r"[01]")
_BOOL = re.compile(r"true|false|TRUE|FALSE|[01]")
_IDENTS = re.compile(r"\^?[A-Za-z0-9_]{1,32}(,[A-Za-z0-9_]{1,32}){0,15}")
_IFNAMES = re.compile(r"[=^]?[A-Za-z0-9_.:-]{1,32}(,[A-Za-z0-9_.:-]{1,32}){0,15}")
_LEVEL = re.compile(r"[0-9]|LOC|NVL|PIX|PXB|PHB|SYS")
_DEBUG = re.compile(r"VERSION|WARN|INFO|TRACE")
_ALLOC = re.compile(r"[a-z_]{1,40}:[A-Za-z0-9_.]{1,20}(,[a-z_]{1,40}:[A-Za-z0-9_.]{1,20}){0,7}")

ALLOWED: dict[str, re.Pattern[str]] = {
    # NCCL (NVIDIA GPUs): logging, transports, algorithm choice, channel and buffer sizes.
    "NCCL_DEBUG": _DEBUG,
    "NCCL_DEBUG_SUBSYS": _IDENTS,
    "NCCL_SOCKET_IFNAME": _IFNAMES,
    "NCCL_SOCKET_NTHREADS": _INT,
    "NCCL_NSOCKS_PERTHREAD": _INT,
    "NCCL_IB_DISABLE": _SWITCH,
    "NCCL_IB_TIMEOUT": _INT,
    "NCCL_P2P_DISABLE": _SWITCH,
    "NCCL_SHM_DISABLE": _SWITCH,
    "NCCL_P2P_LEVEL": _LEVEL,
    "NCCL_NET_GDR_LEVEL": _LEVEL,
    "NCCL_ALGO": _IDENTS,
    "NCCL_PROTO": _IDENTS,
    "NCCL_MIN_NCHANNELS": _INT,
    "NCCL_MAX_NCHANNELS": _INT,
    "NCCL_BUFFSIZE": _INT,
    "NCCL_NTHREADS": _INT,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": _INT,
    "TORCH_NCCL_BLOCKING_WAIT": _SWITCH,
    # HCCL (Ascend NPUs): timeouts, buffer size, determinism, intra-node links.
    "HCCL_CONNECT_TIMEOUT": _INT,
    "HCCL_EXEC_TIMEOUT": _INT,
    "HCCL_BUFFSIZE": _INT,
    "HCCL_DETERMINISTIC": _BOOL,
    "HCCL_INTRA_ROCE_ENABLE": _SWITCH,
    "HCCL_INTRA_PCIE_ENABLE": _SWITCH,
    "HCCL_SOCKET_IFNAME": _IFNAMES,
    # Gloo (CPU collectives), threads and the CUDA allocator.
    "GLOO_SOCKET_IFNAME": _IFNAMES,
    "OMP_NUM_THREADS": _INT,
    "CUDA_DEVICE_MAX_CONNECTIONS": _INT,
    "PYTORCH_CUDA_ALLOC_CONF": _ALLOC,
}
"""Variable name -> the full-match pattern its value must have."""


def env_violations(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """`(field, reason)` for every entry of a request's `env` that is not allowed as given."""
    violations = []
    for name in sorted(env):
        value = env[name]
        pattern = ALLOWED.get(name)
        if pattern is None:
            violations.append(
                (
                    f"env[{name}]",
                    "is not a variable a request may set (it could configure the process or "
                    "the loader); allowed: NCCL/HCCL/Gloo tuning, OMP_NUM_THREADS, "
                    "CUDA_DEVICE_MAX_CONNECTIONS, PYTORCH_CUDA_ALLOC_CONF (see docs/security.md)",
                )
            )
        elif pattern.fullmatch(value) is None:
            violations.append(
                (f"env[{name}]", f"value {value[:40]!r} must match {pattern.pattern}")
            )
    return violations


def checked_env(env: Mapping[str, str]) -> dict[str, str]:
    """The request's `env` as a plain dict, or ValueError naming the first bad entry."""
    violations = env_violations(env)
    if violations:
        field, reason = violations[0]
        raise ValueError(f"{field} {reason}")
    return dict(env)
