"""The one place that knows which accelerator exists.

The platform is resolved once per process: Ascend NPU when `torch_npu` imports and reports a
device, else CUDA, else CPU; `MESHLINE_DEVICE=npu|cuda|cpu` overrides the choice (and fails loudly
if the named device is not usable). Everything device-specific the rest of Meshline needs goes
through `current()`: the torch device module, the collective backend, memory statistics,
synchronisation and RNG state. No other file calls `torch.cuda.*` or `torch.npu.*` (kernel
backends under `kernels/cuda/` and `kernels/npu/` excepted).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import logging
import os
import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import psutil
import torch

log = logging.getLogger(__name__)

DEVICE_ENV = "MESHLINE_DEVICE"
KNOWN_DEVICES = ("npu", "cuda", "cpu")


class Platform:
    """One accelerator kind: its torch device type, device module and collective backend."""

    type: str = "cpu"
    backend: str = "gloo"

    def is_available(self) -> bool:
        return True

    @property
    def module(self) -> ModuleType:
        """The torch device module (`torch.cuda`, `torch.npu`, `torch.cpu`)."""
        return torch.get_device_module(self.type)

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: int | None = None) -> torch.device:
        """The torch.device for local device `index` (the current one when None)."""
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, self.module.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        """Make local device `index` current for this process (a no-op on CPU)."""

    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    def memory_allocated(self) -> int:
        """Bytes currently held: device allocator on accelerators, process RSS on CPU."""
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self) -> int:
        """Peak bytes since the last reset: device allocator peak, or the process's peak RSS."""
        return _peak_rss_bytes()

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory window (on CPU the OS keeps the lifetime peak; see docs)."""

    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        del state

    def manual_seed_all(self, seed: int) -> None:
        del seed

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator (no device generator on CPU)."""
        del seed

    def device_name(self) -> str:
        """The model name of the current device ("NVIDIA H100 80GB HBM3", "Ascend910B2", the
        CPU model), used to look up its peak FLOP/s (kernels.peak_flops)."""
        return _cpu_model_name()

    def capture_range(self, start: bool) -> None:
        """Open (`start`) or close the range an external profiler captures: on CUDA
        cudaProfilerStart/Stop, for `nsys profile --capture-range=cudaProfilerApi`; a no-op
        elsewhere."""
        del start


class CpuPlatform(Platform):
    type = "cpu"
    backend = "gloo"


class _AcceleratorPlatform(Platform):
    """Shared behaviour of CUDA and NPU: both mirror the torch.cuda module API."""

    def is_available(self) -> bool:
        return bool(self.module.is_available()) and self.module.device_count() > 0

    def device_count(self) -> int:
        return int(self.module.device_count())

    def set_device(self, index: int) -> None:
        self.module.set_device(index)

    def synchronize(self) -> None:
        self.module.synchronize()

    def memory_allocated(self) -> int:
        return int(self.module.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(self.module.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats()

    def get_rng_state(self) -> torch.Tensor | None:
        return self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.module.set_rng_state(state)

    def manual_seed_all(self, seed: int) -> None:
        self.module.manual_seed_all(seed)

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(seed)

    def device_name(self) -> str:
        return str(self.module.get_device_name(self.module.current_device()))


class CudaPlatform(_AcceleratorPlatform):
    type = "cuda"
    backend = "nccl"

    def capture_range(self, start: bool) -> None:
        if start:
            self.module.profiler.start()
        else:
            self.module.profiler.stop()


class NpuPlatform(_AcceleratorPlatform):
    type = "npu"
    backend = "hccl"

    def is_available(self) -> bool:
        if not _import_torch_npu():
            return False
        return super().is_available()


PLATFORMS: dict[str, type[Platform]] = {
    "npu": NpuPlatform,
    "cuda": CudaPlatform,
    "cpu": CpuPlatform,
}


def _import_torch_npu() -> bool:
    """Import torch_npu if installed (it registers torch.npu); False when absent or broken."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    except Exception as exc:  # a broken CANN install must not stop CPU/GPU use
        log.warning("torch_npu is installed but failed to import (%s); not using the NPU", exc)
        return False
    return True


def _cpu_model_name() -> str:
    """/proc/cpuinfo's "model name" (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def _peak_rss_bytes() -> int:
    import resource

    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def resolve(name: str | None = None) -> Platform:
    """Resolve a platform: `name` if given, else $MESHLINE_DEVICE, else the best available."""
    requested = name or os.environ.get(DEVICE_ENV, "").strip().lower() or None
    if requested is not None:
        if requested not in PLATFORMS:
            raise ValueError(
                f"{DEVICE_ENV}={requested!r} is not a known device; use one of {', '.join(KNOWN_DEVICES)}"
            )
        platform = PLATFORMS[requested]()
        if not platform.is_available():
            raise RuntimeError(
                f"{DEVICE_ENV}={requested!r} but no usable {requested} device was found "
                f"(unset {DEVICE_ENV} to fall back automatically)"
            )
        return platform
    for key in KNOWN_DEVICES:
        platform = PLATFORMS[key]()
        if platform.is_available():
            return platform
    raise AssertionError("the CPU platform is always available")


@functools.lru_cache(maxsize=1)
def current() -> Platform:
    """The platform of this process, resolved once."""
    platform = resolve()
    log.debug("meshline device: %s (collective backend %s)", platform.type, platform.backend)
    return platform


# ---------------------------------------------------------------------------------------------
# Distributed initialisation


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (torchrun's environment)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env: dict[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} must be an integer") from None


def dist_info_from_env(
    env: dict[str, str] | None = None, platform: Platform | None = None
) -> DistInfo:
    """Read rank, local rank and world size from torchrun's variables (single process if unset)."""
    env = dict(os.environ) if env is None else env
    platform = platform or current()
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent: need 0 <= RANK < WORLD_SIZE"
        )
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world_size} are inconsistent"
        )
    if platform.type != "cpu":
        count = platform.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has only {count} {platform.type} devices; "
                f"start at most {count} processes per node (--nproc-per-node)"
            )
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=platform.torch_device(local_rank) if platform.type != "cpu" else torch.device("cpu"),
        backend=platform.backend,
    )


def process_group_backend(platform_type: str, device_backend: str) -> str:
    """The default process group's backend string for a platform.

    On an accelerator the group gets two backends, "cpu:gloo,cuda:nccl" (or "npu:hccl"): device
    tensors go over NCCL/HCCL, and the small host-side agreements a training step makes (token
    counts, the loss, an Inf/NaN or signal vote, a data-cache status) go over gloo. NCCL alone
    refuses a CPU tensor ("No backend type associated with device type cpu"), which is what
    `meshline train --nproc-per-node 1` met on its first GPU run. torchtitan does the same for
    its CPU-side collectives.
    """
    if platform_type == "cpu" or device_backend == "gloo":
        return device_backend
    return f"cpu:gloo,{platform_type}:{device_backend}"


def init_distributed(
    timeout_s: float = 600.0, backend: str | None = None, env: dict[str, str] | None = None
) -> DistInfo:
    """Set this process's device and join the default process group from torchrun's environment.

    A single process (WORLD_SIZE unset or 1) gets no process group unless MASTER_ADDR is set, so
    plain `python -m ...` runs need no launcher. Calling it again returns the same info. Without
    an explicit `backend`, an accelerator's group also carries gloo for CPU tensors
    (`process_group_backend`).
    """
    platform = current()
    info = dist_info_from_env(env, platform)
    if platform.type != "cpu":
        platform.set_device(info.local_rank)
    chosen = backend or info.backend
    if info.backend != chosen:
        info = DistInfo(**{**info.__dict__, "backend": chosen})
    group_backend = backend or process_group_backend(platform.type, chosen)
    wanted = info.world_size > 1 or "MASTER_ADDR" in (os.environ if env is None else env)
    if wanted and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=group_backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=info.device if platform.type != "cpu" else None,
        )
    return info


def destroy_distributed() -> None:
    """Leave the default process group if this process joined one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# RNG and memory


def seed_everything(seed: int, rank_offset: int = 0) -> int:
    """Seed Python, NumPy, torch (CPU) and the device RNGs with `seed + rank_offset`.

    Use rank_offset=0 where ranks must agree (weight init, data order) and a per-rank offset where
    they must differ (dropout across data-parallel ranks). Returns the seed used.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    effective = seed + rank_offset
    random.seed(effective)
    np.random.seed(effective % 2**32)
    torch.manual_seed(effective)
    current().manual_seed_all(effective)
    return effective


TorchRngStates = tuple[torch.Tensor, "torch.Tensor | None"]


def reseed_torch_generators(seed: int) -> TorchRngStates:
    """Seed torch's CPU generator and the current device's with `seed`; return their previous
    states for `restore_torch_generators` (a forked stream, e.g. one per tensor-parallel rank)."""
    platform = current()
    saved = (torch.get_rng_state(), platform.get_rng_state())
    torch.default_generator.manual_seed(seed)
    platform.manual_seed(seed)
    return saved


def restore_torch_generators(saved: TorchRngStates) -> None:
    """Put back the generator states `reseed_torch_generators` returned."""
    torch.set_rng_state(saved[0])
    current().set_rng_state(saved[1])


def get_rng_state() -> dict[str, Any]:
    """Every RNG's state, for checkpoints (tensors and plain values only: safe to save)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    device_state = current().get_rng_state()
    if device_state is not None:
        state["device"] = device_state
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what get_rng_state returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    current().set_rng_state(state.get("device"))


@dataclass(frozen=True)
class MemoryStats:
    """Memory in bytes. On CPU `allocated`/`peak` are the process's RSS and peak RSS."""

    device: str
    allocated: int
    peak: int
    rss: int

    def as_gib(self) -> dict[str, float]:
        return {
            "allocated": self.allocated / 2**30,
            "peak": self.peak / 2**30,
            "rss": self.rss / 2**30,
        }


def memory_stats() -> MemoryStats:
    platform = current()
    return MemoryStats(
        device=platform.type,
        allocated=platform.memory_allocated(),
        peak=platform.max_memory_allocated(),
        rss=psutil.Process().memory_info().rss,
    )


def reset_peak_memory_stats() -> None:
    current().reset_peak_memory_stats()


def synchronize() -> None:
    current().synchronize()
