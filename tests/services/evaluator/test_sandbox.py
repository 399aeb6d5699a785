"""The HumanEval sandbox really runs code, and contains what must not escape.

Each case is a real program run in its own limited process: a correct solution passes; an
infinite loop, a fork bomb, a memory bomb, a write outside the temporary directory and a network
connection are all stopped and count as failures, with nothing left behind.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from services.evaluator.sandbox.runner import SandboxLimits, isolation, run_program
from services.evaluator.tasks import get_task
from tests.services.evaluator.lm_eval_ref import FIXTURES

LIMITS = SandboxLimits(timeout_s=4.0, cpu_seconds=4, memory_bytes=512 << 20, max_processes=8)
# Without namespaces the sandbox refuses to run (tests/security/test_sandbox_refusal.py).
pytestmark = pytest.mark.skipif(
    not isolation().available, reason=f"no namespace isolation here: {isolation().reason}"
)


def test_correct_solution_passes_and_wrong_one_fails():
    ok = run_program("def f(x):\n    return x + 1\n\nassert f(1) == 2\nimport math\n", LIMITS)
    assert (ok.passed, ok.status) == (True, "passed")
    wrong = run_program("def f(x):\n    return x\n\nassert f(1) == 2\n", LIMITS)
    assert (wrong.passed, wrong.status) == (False, "failed")
    assert "AssertionError" in wrong.detail


def test_exit_before_the_tests_is_not_a_pass():
    result = run_program("import sys\nsys.exit(0)\nassert False\n", LIMITS)
    assert not result.passed


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", LIMITS)
    assert (result.passed, result.status) == (False, "timeout")
    assert time.monotonic() - start < LIMITS.timeout_s + 5


def test_fork_bomb_is_contained(tmp_path: Path):
    marker = tmp_path / "forked"
    os.chmod(tmp_path, 0o777)
    program = (
        f"import os\nwhile True:\n    pid = os.fork()\n    open({str(marker)!r}, 'a').write('x')\n"
    )
    result = run_program(program, LIMITS)
    assert not result.passed
    assert not marker.exists()


def test_fork_bomb_through_multiprocessing_is_contained():
    program = (
        "import multiprocessing\n"
        "def spin():\n    while True: pass\n"
        "for _ in range(64):\n    multiprocessing.Process(target=spin).start()\n"
    )
    result = run_program(program, LIMITS)
    assert not result.passed


def test_memory_bomb_fails_inside_its_limit():
    # A generous timeout (the machine may be loaded): the address-space limit must stop it first.
    limits = SandboxLimits(timeout_s=60.0, cpu_seconds=60, memory_bytes=256 << 20)
    result = run_program(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n", limits
    )
    assert not result.passed
    assert result.status in ("failed", "killed")
    assert result.status == "killed" or "MemoryError" in result.detail


def test_write_outside_the_work_directory_is_refused(tmp_path: Path):
    os.chmod(tmp_path, 0o777)
    target = tmp_path / "escaped.txt"
    program = f"with open({str(target)!r}, 'w') as fh:\n    fh.write('pwned')\n"
    result = run_program(program, LIMITS)
    assert not result.passed
    assert not target.exists()
    via_os = run_program(
        f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n", LIMITS
    )
    assert not via_os.passed
    assert not target.exists()


def test_writing_inside_the_work_directory_is_allowed():
    program = "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\n"
    assert run_program(program, LIMITS).passed


def test_network_connection_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted: list[object] = []
    finished = threading.Event()

    def accept() -> None:
        while not finished.is_set():
            try:
                accepted.append(server.accept())
                return
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    program = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'leak')\n"
    )
    result = run_program(program, LIMITS)
    finished.set()
    thread.join()
    server.close()
    assert not result.passed
    assert accepted == []
    if os.geteuid() == 0:
        assert result.network == "namespace"


def test_nothing_outlives_the_sandbox():
    # An unusual process limit marks this test's sandbox in its command line (other tests may
    # run sandboxes at the same time).
    limits = SandboxLimits(timeout_s=1.0, cpu_seconds=5, max_processes=13)
    result = run_program("import time\ntime.sleep(60)\n", limits)
    assert (result.passed, result.status) == (False, "timeout")
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_ours(p)]
    assert leftovers == []


def _is_ours(proc: Path) -> bool:
    try:
        cmdline = (proc / "cmdline").read_text().replace("\0", " ")
    except OSError:
        return False
    return "sandbox/child.py" in cmdline and '"max_processes": 13' in cmdline


@pytest.mark.parametrize("solution_kind", ["canonical", "wrong"])
def test_humaneval_scores_real_execution(solution_kind):
    task = get_task("humaneval")
    docs, _ = task.load(FIXTURES)
    if solution_kind == "canonical":
        completions = [[d["canonical_solution"]] for d in docs]
        expected = 1.0
    else:
        completions = [["    return None\n"] for _ in docs]
        expected = 0.0
    scores = task.process_many(docs, completions)
    assert [s["pass@1,create_test"] for s in scores] == [expected] * len(docs)
