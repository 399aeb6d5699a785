"""One sandbox run from the service's side: stage its directory, start the launcher, judge.

`runner.py` holds the public API; this module writes the run's private directory (config and
sources), starts `launcher.py` in a session of its own, reads its JSON report and turns the
deciding role's exit status into an `Execution`. Nothing the sandboxed programs print is parsed
for the verdict (their stderr is only quoted as the detail).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
LAUNCHER = HERE / "launcher.py"
HARNESS = ("child.py", "wire.py")
_UID_BASE, _UID_SPAN = 200_000, 100_000
OUTPUT_LIMIT = 64 * 1024
_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()


class SandboxError(RuntimeError):
    """The sandbox itself failed to start (not the program)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use."""

    timeout_s: float = 5.0
    """Wall-clock seconds before every process of the run is killed."""
    cpu_seconds: int = 5
    """RLIMIT_CPU (SIGXCPU, then SIGKILL a second later)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS and RLIMIT_DATA: address space of each process."""
    file_size_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file it may write (its captured output included); its private
    /work holds four times this."""
    max_processes: int = 4
    """RLIMIT_NPROC of the run's uid (in its own user namespace, or its own uid as root),
    threads included. With no cgroup, a role's memory is bounded by max_processes ×
    memory_bytes, so this stays small: HumanEval code needs one process."""
    open_files: int = 64
    """RLIMIT_NOFILE."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_seconds", "memory_bytes", "file_size_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")
        if self.max_processes < 1:
            raise ValueError(f"sandbox max_processes must be >= 1, got {self.max_processes}")
        if self.open_files < 8:
            raise ValueError(f"sandbox open_files must be >= 8, got {self.open_files}")


@dataclass(frozen=True)
class Execution:
    """Outcome of one run."""

    passed: bool
    """The verdict: the checker's `check` returned (run_check), or the program ran to its end."""
    status: str
    """"passed", "failed" (raised or was refused), "timeout" or "killed" (by a signal)."""
    detail: str
    """The end of the deciding process's stderr (the exception), or why it was stopped."""
    network: str
    """"namespace" (isolated: an empty network namespace) or "none" (unsafe mode)."""


def _expose(python: str) -> list[str]:
    """Host directories of the interpreter the sandbox needs besides the system ones."""
    paths = {os.path.realpath(sys.base_prefix), os.path.dirname(python)}
    system = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/")
    return sorted(p for p in paths if not (p + "/").startswith(system))


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - OUTPUT_LIMIT))
            return fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def run(roles: list[dict], verdict: str, limits: SandboxLimits, isolate: bool) -> Execution:
    directory = Path(tempfile.mkdtemp(prefix="meshline-sandbox-"))
    python = os.path.realpath(sys.executable)
    uid_base = _take_uids() if os.geteuid() == 0 else None
    try:
        for index, role in enumerate(roles):
            name = role["name"]
            role.update(
                stdout=str(directory / f"{name}.out"), stderr=str(directory / f"{name}.err")
            )
            role["uid"] = None if uid_base is None else uid_base + index
            if isolate:
                role["root"] = str(directory / f"root-{name}")
                os.mkdir(role["root"], 0o700)
            else:
                _stage_unsafe(directory, role)
        config = {
            "isolate": isolate, "python": python, "expose": _expose(python), "roles": roles,
            "verdict_role": verdict, "seccomp": True, "timeout_s": limits.timeout_s,
            "cpu_seconds": limits.cpu_seconds, "memory_bytes": limits.memory_bytes,
            "file_size_bytes": limits.file_size_bytes, "max_processes": limits.max_processes,
            "open_files": limits.open_files,
            "uids": [r["uid"] for r in roles if r["uid"] is not None],
        }  # fmt: skip
        for role in roles:  # the child's command line names its limits (tests find it by them)
            role["argv"]["max_processes"] = limits.max_processes
        (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
        report = _launch(directory, python, limits)
        return _judge(report, roles, verdict, limits, isolate)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if uid_base is not None:
            with _uids_lock:
                _uids_in_use.discard(uid_base)


def _take_uids() -> int:
    """A random pair of uids (one per role) no other run of this process is using."""
    with _uids_lock:
        while True:
            base = _UID_BASE + 2 * secrets.randbelow(_UID_SPAN // 2)
            if base not in _uids_in_use:
                _uids_in_use.add(base)
                return base


def _stage_unsafe(directory: Path, role: dict) -> None:
    """No namespaces: the role's sources and work dir live in the run's own directory."""
    sandbox, work = directory / f"sandbox-{role['name']}", directory / f"work-{role['name']}"
    sandbox.mkdir(mode=0o755)
    work.mkdir(mode=0o700)
    for name in HARNESS:
        shutil.copy(HERE / name, sandbox / name)
    for name, text in role["files"].items():
        (sandbox / name).write_text(text, encoding="utf-8")
    if role["uid"] is not None:
        os.chmod(directory, 0o711)
        os.chown(work, role["uid"], role["uid"])
    role.update(sandbox=str(sandbox), workdir=str(work), files={})


def _launch(directory: Path, python: str, limits: SandboxLimits) -> dict:
    process = subprocess.Popen(
        [python, "-I", "-S", str(LAUNCHER), str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=limits.timeout_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise SandboxError(f"the sandbox launcher hung past {limits.timeout_s + 30}s") from None
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SandboxError(
            f"the sandbox launcher failed (exit {process.returncode}): {err.decode()[-2000:]}"
        ) from None


def _judge(report: dict, roles: list[dict], verdict: str, limits, isolate: bool) -> Execution:
    network = "namespace" if isolate else "none"
    stderr = {r["name"]: _tail(Path(r["stderr"])) for r in roles}
    code = report["exit"][verdict]
    if code == 125 and stderr[verdict].startswith("sandbox setup:"):
        raise SandboxError(stderr[verdict].strip())
    detail = stderr[verdict].strip()
    serve = report["exit"].get("serve")
    if serve not in (None, 0) and stderr.get("serve", "").strip():
        detail += "\n" + stderr["serve"].strip()[-1000:]
    if report["timeout"]:
        return Execution(False, "timeout", f"killed after {limits.timeout_s}s", network)
    if code is not None and code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return Execution(False, "killed", f"killed by {name}", network)
    passed = code == 0 and (verdict != "program" or report["marker"])
    return Execution(passed, "passed" if passed else "failed", detail[-2000:], network)
