"""The device layer on CPU, and init_distributed on real gloo processes."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from torch.distributed import TCPStore

from kernels import device
from tests.harness import run_distributed


def test_resolves_cpu_here_once() -> None:
    platform = device.current()
    assert platform is device.current()
    assert platform.type == "cpu"
    assert platform.backend == "gloo"
    assert platform.torch_device() == torch.device("cpu")


def test_env_override_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.resolve().type == "cpu"
    monkeypatch.setenv(device.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=r"MESHLINE_DEVICE='tpu'.*npu, cuda, cpu"):
        device.resolve()
    monkeypatch.setenv(device.DEVICE_ENV, "npu")
    with pytest.raises(RuntimeError, match="no usable npu device"):
        device.resolve()


def test_torch_npu_is_optional() -> None:
    # No torch_npu here: the NPU platform reports unavailable instead of raising.
    assert device.NpuPlatform().is_available() is False


def test_dist_info_validates_torchrun_env() -> None:
    info = device.dist_info_from_env(
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (1, 4, 1, "gloo")
    assert not info.is_main
    single = device.dist_info_from_env({})
    assert (single.rank, single.world_size, single.is_main) == (0, 1, True)
    with pytest.raises(ValueError, match="RANK=4 and WORLD_SIZE=4"):
        device.dist_info_from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two' must be an integer"):
        device.dist_info_from_env({"WORLD_SIZE": "two"})


def test_seed_everything_and_rng_state_round_trip() -> None:
    device.seed_everything(1234)
    first = (random.random(), np.random.rand(), torch.rand(3))
    device.seed_everything(1234)
    state = device.get_rng_state()
    assert (random.random(), np.random.rand()) == first[:2]
    assert torch.equal(torch.rand(3), first[2])
    device.set_rng_state(state)
    assert (random.random(), np.random.rand()) == first[:2]
    assert torch.equal(torch.rand(3), first[2])
    assert device.seed_everything(10, rank_offset=3) == 13
    with pytest.raises(ValueError, match="seed must be >= 0"):
        device.seed_everything(-1)


def test_memory_stats_on_cpu_track_rss() -> None:
    import mmap

    before = device.memory_stats()
    # 64 MiB of fresh anonymous pages, touched: not from malloc, which may hand back memory a
    # worker keeps after earlier tests (kernels/cpu/allocator.py) without the RSS moving.
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\x01" * (64 * 2**20))
    after = device.memory_stats()
    assert after.device == "cpu"
    assert after.rss >= before.rss + 48 * 2**20
    assert after.peak >= after.rss - 2**20
    block.close()
    device.synchronize()


def _all_reduce_body(rank: int, world_size: int, scale: float) -> tuple[float, int, str]:
    info = device.init_distributed()  # second call: returns the same info, no re-init
    value = torch.tensor([float(rank + 1) * scale])
    torch.distributed.all_reduce(value)
    return value.item(), info.world_size, torch.distributed.get_backend()


@pytest.mark.dist
def test_init_distributed_all_reduce_on_two_gloo_processes() -> None:
    results = run_distributed(_all_reduce_body, 2, 2.0)
    assert results == [(6.0, 2, "gloo"), (6.0, 2, "gloo")]


def _tensor_body(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


@pytest.mark.dist
def test_harness_returns_tensors_from_children() -> None:
    results = run_distributed(_tensor_body, 2)
    assert [r.tolist() for r in results] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]


def test_accelerator_process_group_carries_gloo_for_cpu_tensors() -> None:
    assert device.process_group_backend("cpu", "gloo") == "gloo"
    assert device.process_group_backend("cuda", "nccl") == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend("npu", "hccl") == "cpu:gloo,npu:hccl"


def _host_and_device_body(rank: int, world_size: int) -> tuple[float, str]:
    # The backend string an accelerator gets, with gloo standing in for its device backend on a
    # CPU machine: a host tensor all-reduce goes through the "cpu:" entry.
    #
    # The new group meets at a store of its own: rank 0 hosts it on a port the OS assigns and
    # sends the port over the old group. Re-joining through the launcher's store raced:
    # destroying the default group resets torch's group count, so the new group's keys equal the
    # old ones, and a rank could read the other's old gloo address there; its all-reduce then
    # failed with "Connection reset by peer" (CI, stop 27).
    store = (
        TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        if rank == 0
        else None
    )
    port = [store.port if store is not None else None]
    torch.distributed.broadcast_object_list(port, src=0)
    if store is None:
        store = TCPStore("127.0.0.1", port[0], world_size, is_master=False)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    torch.distributed.init_process_group(
        backend=device.process_group_backend("cuda", "nccl").replace("nccl", "gloo"),
        store=store,
        rank=rank,
        world_size=world_size,
    )
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value)
    return value.item(), torch.distributed.get_backend()


@pytest.mark.dist
def test_two_backend_group_reduces_host_tensors() -> None:
    results = run_distributed(_host_and_device_body, 2)
    assert [r[0] for r in results] == [3.0, 3.0]
    assert all("cpu:gloo" in r[1] for r in results)


@pytest.mark.gpu
def test_single_process_launch_reduces_host_tensors_over_the_device_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun --nproc-per-node 1 on a GPU: MASTER_ADDR set, world size 1, NCCL for the device;
    a CPU tensor all-reduce (the trainer's signal vote) must not fail."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        device.init_distributed(timeout_s=60)
        host = torch.tensor([2.0])
        torch.distributed.all_reduce(host)
        on_device = torch.tensor([3.0], device=device.current().torch_device())
        torch.distributed.all_reduce(on_device)
        assert host.item() == 2.0 and on_device.item() == 3.0
    finally:
        device.destroy_distributed()


def test_capture_range_is_cudas_profiler_api_and_a_no_op_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--profile` opens the cudaProfilerApi range through the device layer (nsys captures it);
    CPU and NPU have none. On CUDA it is torch.cuda.profiler's start/stop, checked here through a
    stand-in module (the call itself needs a GPU)."""
    device.CpuPlatform().capture_range(start=True)  # no CUDA runtime touched
    device.CpuPlatform().capture_range(start=False)
    calls: list[str] = []
    profiler = types.SimpleNamespace(
        start=lambda: calls.append("start"), stop=lambda: calls.append("stop")
    )
    monkeypatch.setattr(
        device.CudaPlatform,
        "module",
        property(lambda self: types.SimpleNamespace(profiler=profiler)),
    )
    cuda = device.CudaPlatform()
    cuda.capture_range(start=True)
    cuda.capture_range(start=False)
    assert calls == ["start", "stop"]
