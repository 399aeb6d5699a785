"""Hostile completions against the real HumanEval sandbox, each judged by its side effect.

Escapes (`sandbox_corpus.ESCAPES`) must leave no marker file, make no connection, read no
secret, kill no sentinel and leave no process behind; forgeries (`FORGERIES`) return a wrong
answer and must score 0 whatever they print, exit with or patch. Control cases show that the
same probes do see the effects without the sandbox, and that a correct answer scores 1. Where
the host has no namespaces these tests skip (test_sandbox_refusal.py covers that host).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from string import Template

import pytest

from services.evaluator.sandbox.runner import SandboxLimits, isolation, run_check, run_program
from services.evaluator.tasks.humaneval import HumanEval
from tests.security.sandbox_corpus import DOC, ESCAPES, FORGERIES, UNSANDBOXED

LIMITS = SandboxLimits(timeout_s=6.0, cpu_seconds=4, memory_bytes=512 << 20, max_processes=8)
pytestmark = pytest.mark.skipif(
    not isolation().available, reason=f"no namespace isolation here: {isolation().reason}"
)


class Listener:
    """A TCP listener on 127.0.0.1 and an abstract unix socket, counting what connects."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.abstract = f"meshline-test-{secrets.token_hex(8)}"
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.abstract)
        self.unix.listen(4)
        self.accepted = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, args=(s,)) for s in (self.tcp, self.unix)
        ]
        for thread in self._threads:
            thread.start()

    def _accept(self, server: socket.socket) -> None:
        server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                connection, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        time.sleep(0.3)  # a connection made at the very end is still counted
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.tcp.close()
        self.unix.close()


@pytest.fixture
def world(tmp_path: Path):
    """What the attacks aim at: writable dir, secrets, a listener, a sentinel process."""
    os.chmod(tmp_path, 0o777)  # writable by anyone: only the sandbox may stop a write
    token = secrets.token_hex(16)
    secret, public = tmp_path / "secret.key", tmp_path / "public.txt"
    secret.write_text(f"secret-{token}")
    secret.chmod(0o600)
    public.write_text(f"public-{token}")
    public.chmod(0o644)
    listener = Listener()
    sentinel = subprocess.Popen(
        ["sleep", "300"], env={"MESHLINE_SENTINEL": f"environ-{token}", "PATH": "/usr/bin:/bin"}
    )
    values = {
        "marker": str(tmp_path / "marker"), "port": listener.port, "abstract": listener.abstract,
        "secret": str(secret), "public": str(public), "sentinel": sentinel.pid,
        "token": f"{700 + secrets.randbelow(100)}.{secrets.randbelow(10**6):06d}",
    }  # fmt: skip
    yield values, token, listener, sentinel
    listener.close()
    sentinel.kill()
    sentinel.wait()


def _processes_with(token: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token in (entry / "cmdline").read_text():
                found.append(entry.name)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_is_contained(name, world):
    values, token, listener, sentinel = world
    kind, template = ESCAPES[name]
    completion = Template(template).substitute(values)
    result = run_check(HumanEval().check(DOC, completion), LIMITS)
    listener.close()
    assert result.network == "namespace"
    assert not Path(values["marker"]).exists()
    assert listener.accepted == 0
    assert token not in result.detail
    assert sentinel.poll() is None, "the sentinel process was killed from inside the sandbox"
    assert _processes_with(values["token"]) == []
    if kind == "secret":
        assert not result.passed


@pytest.mark.parametrize("name", UNSANDBOXED)
def test_escape_works_without_the_sandbox(name, world):
    """Control: the same completion run as a plain process does what the probes look for."""
    values, token, listener, _ = world
    kind, template = ESCAPES[name]
    source = DOC["prompt"] + Template(template).substitute(values) + "\nadd(2, 3)\n"
    run = subprocess.run(
        [sys.executable, "-c", source], cwd=values["marker"].rsplit("/", 1)[0], capture_output=True,
        text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    listener.close()
    effects = {
        "marker": Path(values["marker"]).exists(),
        "connect": listener.accepted > 0,
        "abstract": listener.accepted > 0,
        "secret": token in run.stderr,
    }
    assert effects[kind], run.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdict_scores_zero(name):
    completion = FORGERIES[name]
    task = HumanEval(limits=SandboxLimits(timeout_s=4.0, cpu_seconds=3, memory_bytes=512 << 20))
    start = time.monotonic()
    (scores,) = task.process_many([DOC], [[completion]])
    assert scores == {"pass@1,create_test": 0.0}
    assert time.monotonic() - start < 40


def test_correct_completion_scores_one():
    """Control for the forgeries: the same harness passes a right answer."""
    (scores,) = HumanEval().process_many([DOC], [[DOC["canonical_solution"]]])
    assert scores == {"pass@1,create_test": 1.0}


def test_fork_bomb_leaves_nothing_behind():
    # An unusual process limit marks this run's processes in their command lines.
    limits = SandboxLimits(timeout_s=3.0, cpu_seconds=3, memory_bytes=256 << 20, max_processes=11)
    bomb = "    return a + b\n\n\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_check(HumanEval().check(DOC, bomb), limits)
    assert not result.passed
    time.sleep(0.2)
    assert _processes_with('"max_processes": 11') == []


def test_parent_of_the_sandbox_survives_signals():
    """The process that runs the sandbox (this one) and its group are out of reach."""
    attack = "    return a + b\n\n\nimport os\nfor sig in (15, 9):\n    for pid in (0, -1, 1, os.getppid()):\n"
    attack += (
        "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
    )
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        run_check(HumanEval().check(DOC, attack), LIMITS)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == []


SELF_REPORT = """
import ctypes, errno, os, resource, socket
fields = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
assert os.getpid() == 1, 'PID 1 of a new PID namespace'
assert fields['NoNewPrivs'].strip() == '1'
assert fields['Seccomp'].strip() == '2', 'a seccomp filter is loaded'
assert int(fields['CapEff'], 16) == int(fields['CapPrm'], 16) == 0, 'no capabilities'
assert os.getuid() != 0 and os.geteuid() != 0 and os.getgroups() == []
assert socket.gethostname() == 'sandbox'
for hidden in ('/etc', '/home', '/var', '/run', '/root/.ssh'):
    assert not os.path.exists(hidden), hidden
try:
    open('/usr/escape', 'w')
    raise AssertionError('the root is writable')
except OSError as exc:
    assert exc.errno in (errno.EROFS, errno.EACCES), exc
open('/work/scratch', 'w').write('ok')
interfaces = [line.split(':')[0].strip() for line in open('/proc/net/dev').read().splitlines()[2:]]
assert interfaces == ['lo'], interfaces
libc = ctypes.CDLL(None, use_errno=True)
assert libc.ptrace(0, 0, 0, 0) == -1 and ctypes.get_errno() == errno.EPERM, 'ptrace refused'
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (64, 64)
assert resource.getrlimit(resource.RLIMIT_NPROC) == (8, 8)
assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)
assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}, sorted(os.environ)
"""


def test_the_sandbox_reports_its_own_confinement():
    """From the inside: PID 1, no_new_privs, seccomp, no capabilities, no host files, lo only."""
    result = run_program(SELF_REPORT, LIMITS)
    assert (result.passed, result.network) == (True, "namespace"), result.detail


def test_stop_iteration_cannot_end_the_tests_loop_early():
    """`for r in map(candidate, ...)` ends silently on StopIteration in one process (lm-eval);
    here the candidate's StopIteration arrives as RuntimeError and fails the test."""
    test = "def check(candidate):\n    for result in map(candidate, [2, 3], [3, 4]):\n        assert result == 99\n"
    check = HumanEval().check({**DOC, "test": test}, "    raise StopIteration\n")
    native = subprocess.run(
        [sys.executable, "-I", "-c", HumanEval().program({**DOC, "test": test}, check.completion)],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert native.returncode == 0  # the one-process harness would have passed it
    assert not run_check(check, LIMITS).passed


def test_leftover_probe_sees_a_process_outside_the_sandbox():
    """Control for the "leftover" escapes: the /proc scan does find such a sleeper."""
    token = f"{900 + secrets.randbelow(99)}.{secrets.randbelow(10**6):06d}"
    sleeper = subprocess.Popen(["sleep", token])
    try:
        time.sleep(0.2)
        assert _processes_with(token) == [str(sleeper.pid)]
    finally:
        sleeper.kill()
        sleeper.wait()
