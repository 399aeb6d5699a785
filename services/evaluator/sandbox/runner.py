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

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.evaluator.sandbox.runs import (
    Execution,
    SandboxError,
    SandboxLimits,
    run,
)

__all__ = [
    "Check", "Execution", "Isolation", "SandboxError", "SandboxLimits", "SandboxUnavailable",
    "isolation", "require_isolation", "run_check", "run_checks", "run_program", "run_programs",
]  # fmt: skip
ISOLATION_ENV = "MESHLINE_SANDBOX_ISOLATION"
"""Set to "off" to behave as on a host without namespaces (tests of the refusal path)."""
UNSAFE_FLAG = "--allow-unsafe-code-execution"


class SandboxUnavailable(RuntimeError):
    """The host cannot isolate generated code and the operator did not allow running it anyway."""


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
                    probe = run(
                        _program_roles(_PROBE), "program", SandboxLimits(timeout_s=30), True
                    )
                    ok = probe.passed
                    result = Isolation(ok, "" if ok else f"the probe failed: {probe.detail[-500:]}")
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
        f"allowed, or pass {UNSAFE_FLAG} (to `meshline serve evaluator` or `meshline "
        "evaluate`) to run it with rlimits, seccomp and a separate uid only"
    )


def run_check(
    check: Check, limits: SandboxLimits | None = None, *, allow_unsafe: bool = False
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
    return run(roles, "check", limits or SandboxLimits(), isolate)


def run_program(
    program: str, limits: SandboxLimits | None = None, *, allow_unsafe: bool = False
) -> Execution:
    """Execute `program` (Python source) in the sandbox and say whether it ran to its end."""
    isolate = require_isolation(allow_unsafe)
    return run(_program_roles(program), "program", limits or SandboxLimits(), isolate)


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
    allow_unsafe: bool = False,
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
    allow_unsafe: bool = False,
) -> list[Execution]:
    """`run_program` over many programs, `workers` at a time; results in order."""
    require_isolation(allow_unsafe)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda p: run_program(p, limits, allow_unsafe=allow_unsafe), programs))
