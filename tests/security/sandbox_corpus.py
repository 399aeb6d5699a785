"""Hostile HumanEval completions: escapes (judged by side effect) and verdict forgeries.

Each completion answers `add(a, b)` (`DOC`). `ESCAPES` try to act outside the sandbox; their
`kind` says which side effect the test checks: "marker" (a file outside the work dir),
"connect" (a listener on 127.0.0.1 or an abstract unix socket), "secret" (a token of a host
file or of another process must not come back in the run's output), "kill" (a sentinel
process must survive) or "leftover" (no process of the run may remain). Their placeholders
($marker, $port, ...) are filled by the test. `FORGERIES` return a wrong answer and try to be
scored as passing anyway. `UNSANDBOXED` names the escapes whose effect the test also shows
without the sandbox (so a probe that cannot fail would be noticed).
"""

from __future__ import annotations

DOC = {
    "task_id": "Hostile/0",
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
RIGHT = "    return a + b\n\n\n"
WRONG = "    return a - b\n\n\n"


def _attempt(code: str) -> str:
    """Module-level attack after a correct body; its failure alone never fails the run."""
    body = "".join(f"    {line}\n" for line in code.strip("\n").splitlines())
    return RIGHT + "try:\n" + body + "except BaseException:\n    pass\n"


ESCAPES: dict[str, tuple[str, str]] = {
    "os_system": ("marker", _attempt('import os\nos.system("touch $marker")')),
    "posix_system": ("marker", _attempt('import posix\nposix.system("touch $marker")')),
    "subprocess": ("marker", _attempt('import subprocess\nsubprocess.run(["touch", "$marker"])')),
    "fork_exec": ("marker", _attempt(
        'import os\npid = os.fork()\nif pid == 0:\n'
        '    os.execv("/usr/bin/touch", ["touch", "$marker"])\nos.waitpid(pid, 0)'
    )),
    "ctypes_system": ("marker", _attempt('import ctypes\nctypes.CDLL(None).system(b"touch $marker")')),
    "io_fileio": ("marker", _attempt('import _io\n_io.FileIO("$marker", "w").write(b"x")')),
    "builtin_open": ("marker", _attempt('open("$marker", "w").write("x")')),
    "os_open": ("marker", _attempt(
        'import os\nos.write(os.open("$marker", os.O_WRONLY | os.O_CREAT, 0o666), b"x")'
    )),
    "proc_root": ("marker", _attempt(
        'for p in ("/proc/1/root$marker", "/proc/self/root$marker", "/proc/self/cwd/../..$marker"):\n'
        '    try:\n        open(p, "w").write("x")\n    except OSError:\n        pass'
    )),
    "symlink": ("marker", _attempt(
        'import os\nos.symlink("$marker", "link")\nopen("link", "w").write("x")'
    )),
    "setuid_root": ("marker", _attempt(
        'import os\nos.setuid(0)\nopen("$marker", "w").write("x")'
    )),
    "unshare_mount": ("marker", _attempt(
        'import ctypes\nlibc = ctypes.CDLL(None)\nlibc.unshare(0x10000000 | 0x20000)\n'
        'libc.mount(b"none", b"/", None, 32 | 4096, None)\nopen("$marker", "w").write("x")'
    )),
    "chroot_breakout": ("marker", _attempt(
        'import os\nos.mkdir("jail")\nos.chroot("jail")\nfor _ in range(64):\n    os.chdir("..")\n'
        'os.chroot(".")\nopen("$marker", "w").write("x")'
    )),
    "multiprocessing": ("marker", _attempt(
        'import multiprocessing\np = multiprocessing.Process(target=lambda: open("$marker", "w"))\n'
        'p.start()\np.join()'
    )),
    "tcp_connect": ("connect", _attempt(
        'import socket\nsocket.create_connection(("127.0.0.1", $port), timeout=2).sendall(b"x")'
    )),
    "raw_socket_module": ("connect", _attempt(
        'import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(("127.0.0.1", $port))'
    )),
    "bash_dev_tcp": ("connect", _attempt(
        "import os\nos.system(\"bash -c 'echo x > /dev/tcp/127.0.0.1/$port'\")"
    )),
    "abstract_unix_socket": ("abstract", _attempt(
        'import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect("\\0$abstract")\ns.sendall(b"x")'
    )),
    "read_secret": ("secret", '    raise ValueError(open("$secret").read())\n'),
    "read_secret_shell": ("secret", '    import os\n    raise ValueError(os.popen("cat $secret").read())\n'),
    "read_public_data": ("secret", '    raise ValueError(open("$public").read())\n'),
    "read_other_environ": ("secret", (
        "    import os\n    seen = []\n    for p in os.listdir('/proc'):\n"
        "        try:\n            seen.append(open(f'/proc/{p}/environ').read())\n"
        "        except OSError:\n            pass\n    raise ValueError(' '.join(seen))\n"
    )),
    "kill_parent": ("kill", _attempt('import os\nos.kill(os.getppid(), 9)')),
    "kill_everything": ("kill", _attempt('import os\nos.kill(-1, 9)')),
    "kill_sentinel_pid": ("kill", _attempt('import os\nos.kill($sentinel, 9)')),
    "kill_every_proc_entry": ("kill", _attempt(
        'import os\nfor p in os.listdir("/proc"):\n    if p.isdigit() and int(p) != os.getpid():\n'
        '        try:\n            os.kill(int(p), 9)\n        except OSError:\n            pass'
    )),
    "daemonized_sleeper": ("leftover", _attempt(
        'import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n'
        '        os.execv("/usr/bin/sleep", ["sleep", "$token"])\n    os._exit(0)'
    )),
    "sigterm_immune_sleeper": ("leftover", _attempt(
        'import os, signal\nif os.fork() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
        '    os.execv("/usr/bin/sleep", ["sleep", "$token"])'
    )),
}  # fmt: skip
UNSANDBOXED = (
    "os_system", "posix_system", "subprocess", "fork_exec", "ctypes_system", "io_fileio",
    "builtin_open", "os_open", "symlink", "tcp_connect", "raw_socket_module", "bash_dev_tcp",
    "abstract_unix_socket", "read_secret", "read_secret_shell", "read_public_data",
)  # fmt: skip

FORGERIES: dict[str, str] = {
    "prints_passed": WRONG + 'print("passed")\nprint("\\n" * 3 + "ok")\n',
    "os_exit_0_before_tests": WRONG + "import os\nos._exit(0)\n",
    "sys_exit_0": WRONG + "import sys\nsys.exit(0)\n",
    "systemexit_in_del": WRONG + (
        "class Quit:\n    def __del__(self):\n        raise SystemExit(0)\n\n\nquit_on_exit = Quit()\n"
    ),
    "nonce_from_frames": WRONG + (
        "import os, sys\nprint('passed')\nleave = os._exit\nframe = sys._getframe()\n"
        "while frame is not None:\n"
        "    for name, value in [*frame.f_locals.items(), *frame.f_globals.items()]:\n"
        "        if isinstance(value, str) and len(value) == 32:\n            print('\\n' + value)\n"
        "        if name == 'exit_now':\n            leave = value\n"
        "    frame = frame.f_back\nsys.stdout.flush()\nleave(0)\n"
    ),
    "patch_assertion_error": WRONG + (
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
    ),
    "override_check": WRONG + (
        "import builtins\ncheck = builtins.check = lambda candidate: None\n"
    ),
    "always_equal_object": (
        "    class Equal:\n        def __eq__(self, other):\n            return True\n\n"
        "    return Equal()\n"
    ),
    "int_subclass_equal": (
        "    class Int(int):\n        def __eq__(self, other):\n            return True\n\n"
        "    return Int(0)\n"
    ),
    "atexit_os_exit": WRONG + "import atexit, os\natexit.register(os._exit, 0)\n",
    "forged_replies": WRONG + "import os\nfor fd in range(3, 10):\n    try:\n"
    "        os.write(fd, b'{\"ok\": 5}\\n' * 8)\n    except OSError:\n        pass\n",
    "garbage_reply": WRONG + "import os\nos.write(4, b'garbage\\n')\n",
    "kill_every_process": WRONG + "import os\nos.kill(-1, 9)\n",
    "ignore_sigterm_and_hang": WRONG + (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n"
    ),
    "ptrace_the_checker": WRONG + (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\nfor pid in range(1, 200):\n"
        "    libc.ptrace(16, pid, 0, 0)\n"
    ),
    "systemexit_from_call": "    raise SystemExit(0)\n",
    "keyboard_interrupt_from_call": "    raise KeyboardInterrupt\n",
    "huge_reply": "    return 'x' * (32 << 20)\n",
    "settrace_and_gc_patch": WRONG + (
        "import gc, sys\nsys.settrace(lambda *a: None)\nfor obj in gc.get_objects():\n"
        "    if getattr(obj, '__name__', '') == 'check':\n        obj.__code__ = (lambda c: None).__code__\n"
    ),
    "generator_instead_of_value": "    yield a + b\n",
    "stop_iteration_from_call": "    raise StopIteration\n",
}  # fmt: skip
