"""How many CPU threads this process may use, and how its OpenMP threads wait.

Two things go wrong on a shared CPU (a node running other jobs, a pod with a CPU quota):

- Thread pools sized from the host's core count (`os.cpu_count()`) oversubscribe a cgroup
  quota: a pod limited to 2 CPUs on a 64-core host that starts 64 threads is throttled every
  scheduling period. `available_cpus()` is the smaller of the CPUs in this process's affinity
  mask and the cgroup's CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`,
  the tightest over the process's cgroup and its ancestors), rounded up, at least 1.
  `apply_torch_threads()` caps torch's intra- and inter-op pools (which the C kernels and the
  C decode step take their thread count from) to it, unless OMP_NUM_THREADS says otherwise.
- libgomp's default wait policy spins at every barrier before sleeping. When another process
  holds one of the cores, the thread that a team waits for is descheduled and its partner spins
  away the CPU time it would need: a 4-layer served decode step went from 0.8 ms a token quiet
  to 135 ms beside two busy processes (bench/RESULTS.md), and 1.7 ms with
  OMP_WAIT_POLICY=PASSIVE. The services set it (when neither it nor GOMP_SPINCOUNT is set)
  in `services/__init__.py`, before anything loads torch and with it the OpenMP runtime, which
  reads its environment once; the worker processes they start inherit it. A program using
  these libraries directly sets it itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
THREADS_ENV = "OMP_NUM_THREADS"


def cgroup_cpu_quota(
    root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """CPUs this process's cgroup may use per period (e.g. 1.5), the tightest limit of its
    cgroup and every ancestor, v2 or v1; None when no limit is set or none can be read."""
    quotas = [q for d in _cgroup_dirs(root, self_cgroup) if (q := _quota_in(d)) is not None]
    return min(quotas) if quotas else None


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; `os.cpu_count()` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_cpus(
    root: Path = CGROUP_ROOT,
    self_cgroup: Path = PROC_SELF_CGROUP,
    affinity: int | None = None,
) -> int:
    """Threads worth running: the affinity mask's CPU count capped by the cgroup quota (rounded
    up: a 1.5-CPU quota still gives two threads time), at least 1."""
    cpus = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpu_quota(root, self_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return max(1, cpus)


def apply_torch_threads(environ: MutableMapping[str, str] | None = None) -> int:
    """Cap torch's intra-op threads (and, while still settable, its inter-op threads) at
    `available_cpus()`, unless OMP_NUM_THREADS is set (then the user's count stands); returns
    the intra-op thread count in effect. Never raises the count above torch's own default
    (torch picks physical cores, fewer than the affinity mask's on SMT machines)."""
    import torch

    env = os.environ if environ is None else environ
    if env.get(THREADS_ENV, "").strip():
        return torch.get_num_threads()
    cpus = available_cpus()
    if torch.get_num_threads() > cpus:
        log.info(
            "CPU threads: %d (the cgroup quota / affinity mask; os.cpu_count() says %s)",
            cpus,
            os.cpu_count(),
        )
        torch.set_num_threads(cpus)
    if torch.get_num_interop_threads() > cpus:
        # RuntimeError: the inter-op pool already started; it stays as it is.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(cpus)
    return torch.get_num_threads()


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[Path]:
    """The cgroup directories whose CPU limits apply to this process: its own and every
    ancestor up to `root`, for the v2 hierarchy and v1's cpu controller (those that exist)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            bases = [root]  # v2: the unified hierarchy (at root, or root/unified in hybrid mode)
            if (root / "unified").is_dir():
                bases.append(root / "unified")
        elif "cpu" in controllers.split(","):
            bases = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
        else:
            continue
        for base in bases:
            found += _ancestors(base, path)
    return list(dict.fromkeys(found))


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base`/`path` and its parents up to `base`, those that exist (a container sees its own
    cgroup at `base` while /proc/self/cgroup names the host's path)."""
    dirs = [base]
    current = base
    for part in (p for p in path.strip("/").split("/") if p and p not in (".", "..")):
        current = current / part
        dirs.append(current)
    return [d for d in dirs if d.is_dir()]


def _quota_in(directory: Path) -> float | None:
    """The CPU quota set in one cgroup directory (v2 or v1), None when unlimited or unreadable."""
    try:
        fields = (directory / "cpu.max").read_text().split()
        if len(fields) >= 1 and fields[0] != "max":
            period = int(fields[1]) if len(fields) > 1 else 100_000
            return int(fields[0]) / period if period > 0 and int(fields[0]) > 0 else None
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
