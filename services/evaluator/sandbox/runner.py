"""Run untrusted code in an OS-level sandbox and decide the verdict outside it.

`run_check` judges a completion the way HumanEval does (the test's `check(candidate)` must
return) but in two sandboxes: the completion runs alone in one ("serve"), the test code in the
other ("check"), and calls of the entry point travel between them as plain values
(`sandbox/wire.py`). The verdict is the checker's exit status, read by the launcher; the
completion never runs in the process that decides it and cannot print, forge or reach it.
`run_program` runs one program and says whether it reached its end (a verdict the program
itself could fake: meant for programs that are not adversarial, such as tests' own probes).

Each run is one `launcher.py` process (see its docstring for the isolation: namespaces, a
read-only minimal root, a uid of its own, rlimits, no_new_privs, seccomp). `isolation()` probes
once whether the host allows it; without it code runs only if the operator allowed unsafe
execution (`--allow-unsafe-code-execution`), and then with rlimits, seccomp and (as root) a
separate uid alone.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
LAUNCHER = HERE / "launcher.py"
HARNESS = ("child.py", "wire.py")
_UID_BASE, _UID_SPAN = 200_000, 100_000
OUTPUT_LIMIT = 64 * 1024
ISOLATION_ENV = "MESHLINE_SANDBOX_ISOLATION"
"""Set to "off" to behave as on a host without namespaces (tests of the refusal path)."""
UNSAFE_FLAG = "--allow-unsafe-code-execution"


class SandboxUnavailable(RuntimeError):
    """The host cannot isolate generated code and the operator did not allow running it anyway."""


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
    max_processes: int = 16
    """RLIMIT_NPROC of the run's uid (in its own user namespace, or its own uid as root)."""
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


@dataclass(frozen=True)
class Check:
    """One HumanEval-style judgement: `test` defines `check(candidate)` for `entry_point`."""

    prompt: str
    """Trusted task text run before the completion (and alone in the checker, for helpers)."""
    completion: str
    """Untrusted generated code."""
    test: str
    """Trusted test code defining `check(candidate)`."""
    entry_point: str
    """Name of the function under test."""


@dataclass(frozen=True)
class Isolation:
    """Whether this host can isolate generated code, and why not."""

    available: bool
    reason: str


_probe_lock = threading.Lock()
_probed: dict[str, Isolation] = {}
_PROBE = (
    "import os, socket\n"
    "assert os.getpid() == 1, 'not PID 1 of a new PID namespace'\n"
    "assert not os.path.exists('/etc'), 'the host root is visible'\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    "except OSError as exc:\n"
    "    assert exc.errno == 101, f'network reachable: {exc}'\n"
)


def isolation() -> Isolation:
    """Probes (once per process) by running a program that checks its own confinement."""
    override = os.environ.get(ISOLATION_ENV, "")
    with _probe_lock:
        if override not in _probed:
            if override == "off":
                result = Isolation(False, f"{ISOLATION_ENV}=off disables namespace isolation")
            else:
                try:
                    run = _run(_program_roles(_PROBE), "program", SandboxLimits(timeout_s=30), True)
                    ok = run.passed
                    result = Isolation(ok, "" if ok else f"the probe failed: {run.detail[-500:]}")
                except (OSError, SandboxError) as exc:
                    result = Isolation(False, f"the probe could not start: {exc}")
            _probed[override] = result
        return _probed[override]


def require_isolation(allow_unsafe: bool) -> bool:
    """True to isolate; False when the host cannot and `allow_unsafe`; SandboxUnavailable else."""
    state = isolation()
    if state.available:
        return True
    if allow_unsafe:
        return False
    raise SandboxUnavailable(
        "this host cannot isolate generated code in user/PID/mount/network namespaces "
        f"({state.reason}), so HumanEval will not run it; run where unprivileged namespaces are "
        f"allowed, or restart with {UNSAFE_FLAG} to run it with rlimits and a separate uid only"
    )


def run_check(
    check: Check, limits: SandboxLimits | None = None, *, allow_unsafe=False
) -> Execution:
    """Judge `check.completion`: passed only when the test's `check` returned in the checker."""
    isolate = require_isolation(allow_unsafe)
    common = {"entry_point": check.entry_point}
    roles = [
        {"name": "serve", "files": {"candidate.py": check.prompt + check.completion + "\n"},
         "argv": {"role": "serve", "program": "candidate.py", **common}},
        {"name": "check", "files": {"prompt.py": check.prompt, "test.py": check.test},
         "argv": {"role": "check", "prompt": "prompt.py", "test": "test.py", **common}},
    ]  # fmt: skip
    return _run(roles, "check", limits or SandboxLimits(), isolate)


def run_program(
    program: str, limits: SandboxLimits | None = None, *, allow_unsafe=False
) -> Execution:
    """Execute `program` (Python source) in the sandbox and say whether it ran to its end."""
    isolate = require_isolation(allow_unsafe)
    return _run(_program_roles(program), "program", limits or SandboxLimits(), isolate)


def _program_roles(program: str) -> list[dict]:
    files = {"program.py": program}
    return [
        {"name": "program", "files": files, "argv": {"role": "program", "program": "program.py"}}
    ]


def run_checks(
    checks: list[Check],
    limits: SandboxLimits | None = None,
    workers: int = 2,
    *,
    allow_unsafe=False,
) -> list[Execution]:
    """`run_check` over many checks, `workers` at a time; results in order."""
    require_isolation(allow_unsafe)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda c: run_check(c, limits, allow_unsafe=allow_unsafe), checks))


def run_programs(
    programs: list[str],
    limits: SandboxLimits | None = None,
    workers: int = 2,
    *,
    allow_unsafe=False,
) -> list[Execution]:
    """`run_program` over many programs, `workers` at a time; results in order."""
    require_isolation(allow_unsafe)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda p: run_program(p, limits, allow_unsafe=allow_unsafe), programs))


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


def _run(roles: list[dict], verdict: str, limits: SandboxLimits, isolate: bool) -> Execution:
    directory = Path(tempfile.mkdtemp(prefix="meshline-sandbox-"))
    python = os.path.realpath(sys.executable)
    uid_base = _UID_BASE + 2 * secrets.randbelow(_UID_SPAN // 2) if os.geteuid() == 0 else None
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
