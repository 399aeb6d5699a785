"""CPU thread sizing from the cgroup quota and affinity mask (fake cgroup trees), and the
OpenMP wait policy the services set before torch loads (a real libgomp in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import threads

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path, files: dict[str, str], self_cgroup: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "self_cgroup"
    proc.write_text(self_cgroup)
    return root, proc


def test_v2_quota_rounds_up_and_caps_the_affinity_mask(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, {"cpu.max": "150000 100000\n"}, "0::/\n")
    assert threads.cgroup_cpu_quota(root, proc) == 1.5
    assert threads.available_cpus(root, proc, affinity=8) == 2
    assert threads.available_cpus(root, proc, affinity=1) == 1


def test_v2_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    files = {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "400000 100000\n",
        "kubepods/pod1/cpu.max": "50000 100000\n",
        "kubepods/pod1/c1/cpu.max": "max 100000\n",
    }
    root, proc = _tree(tmp_path, files, "0::/kubepods/pod1/c1\n")
    assert threads.cgroup_cpu_quota(root, proc) == 0.5
    assert threads.available_cpus(root, proc, affinity=64) == 1  # never 0


def test_v2_unlimited_and_missing_leave_the_affinity_mask(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, {"cpu.max": "max 100000\n"}, "0::/\n")
    assert threads.cgroup_cpu_quota(root, proc) is None
    assert threads.available_cpus(root, proc, affinity=6) == 6
    empty, proc = _tree(tmp_path / "e", {}, "garbage line\n")
    assert threads.cgroup_cpu_quota(empty, proc) is None
    assert threads.cgroup_cpu_quota(empty, tmp_path / "absent") is None


def test_a_container_sees_its_own_cgroup_at_the_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, which does not exist inside the container.
    root, proc = _tree(tmp_path, {"cpu.max": "300000 100000\n"}, "0::/system.slice/x.scope\n")
    assert threads.cgroup_cpu_quota(root, proc) == 3.0


def test_v1_cfs_quota(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    root, proc = _tree(tmp_path, files, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert threads.cgroup_cpu_quota(root, proc) == 2.5
    assert threads.available_cpus(root, proc, affinity=16) == 3
    unlimited, proc = _tree(tmp_path / "u", {k: v for k, v in files.items() if "abc" not in k},
                            "3:cpu,cpuacct:/\n")  # fmt: skip
    assert threads.cgroup_cpu_quota(unlimited, proc) is None


def test_this_machine_is_within_its_affinity_mask() -> None:
    assert 1 <= threads.available_cpus() <= len(os.sched_getaffinity(0))


def test_torch_threads_capped_unless_omp_num_threads_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "available_cpus", lambda: 1)
        assert threads.apply_torch_threads({"OMP_NUM_THREADS": "2"}) == 2  # the user's count
        assert threads.apply_torch_threads({}) == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(threads, "available_cpus", lambda: 8)
        assert threads.apply_torch_threads({}) == 1  # never raised above what torch had
    finally:
        torch.set_num_threads(before)


IDLE_CPU = """
import os, sys, time
{imports}
import torch
a = torch.randn(256, 256)
for _ in range(20):
    a @ a
start = time.process_time()
time.sleep(0.4)  # the OpenMP team is idle: does it sleep or spin?
print(os.environ.get("OMP_WAIT_POLICY"), time.process_time() - start)
"""


def _idle_cpu(imports: str, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    clean |= {"OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT), **env}
    out = subprocess.run(
        [sys.executable, "-c", IDLE_CPU.format(imports=imports)],
        capture_output=True, text=True, env=clean, timeout=120, check=True,
    )  # fmt: skip
    policy, seconds = out.stdout.split()
    return policy, float(seconds)


def test_services_make_idle_openmp_threads_sleep() -> None:
    """Importing `services` first sets OMP_WAIT_POLICY=PASSIVE, and libgomp (loaded with
    torch) honours it: an idle 2-thread team then uses no CPU while the main thread sleeps,
    where the ACTIVE policy spins through the whole sleep."""
    policy, passive = _idle_cpu("import services")
    assert policy == "PASSIVE"
    assert passive < 0.05
    policy, active = _idle_cpu("import services", OMP_WAIT_POLICY="ACTIVE")  # the user's wins
    assert policy == "ACTIVE"
    assert active > passive + 0.02


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "active"}, "active"), ({"GOMP_SPINCOUNT": "100"}, "")],
)
def test_services_leave_a_users_wait_settings(env: dict[str, str], expected: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys, services; "
         "print(os.environ.get('OMP_WAIT_POLICY', ''), 'torch' in sys.modules)"],
        capture_output=True, text=True, env=clean | {"PYTHONPATH": str(ROOT)} | env, check=True,
    )  # fmt: skip
    assert out.stdout.split(" ") == [expected, "False\n"]  # and no torch loaded for it
