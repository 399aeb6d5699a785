"""`python -m services.trainer.warm_spare SOCKET`: a process with the training code already
imported that forks a ready worker whenever torchrun (re)starts one.

Why: a worker restart under `--max-restarts` used to cost a whole new interpreter importing torch
and the training library (3–8 s on a busy CPU) against steps of milliseconds; a fork of a process
that has imported them starts training at once. The spare imports everything, then listens on
the unix socket SOCKET (in a private folder the launcher made). Each thin worker that torchrun
starts (`services.trainer.warm_start`) connects, sends its argv, environment and working folder
as JSON and its stdin/stdout/stderr as file descriptors, and the spare forks a child that becomes
that worker: same descriptors, same environment, `services.trainer.train.main(argv)`.

Invariants:
- At most one live child per LOCAL_RANK: a request for a rank whose previous child still runs
  SIGKILLs and reaps that child before forking (so a restarted worker never trains beside the
  one it replaces, whatever the order in which the kernel tells each of them).
- A child never outlives its thin worker: it watches the connection and SIGKILLs itself on EOF
  (the thin worker was killed; torchrun is starting a new one or giving up).
- The spare starts no Python thread (it reaps children by polling) and never runs a torch
  operation, so it is forked in the state in which torch's DataLoader forks its workers on
  Linux: torch imported, no OpenMP pool, no lock held by a thread of ours.
- Only processes of the same user may connect (SO_PEERCRED); a request is at most
  MAX_REQUEST_BYTES of JSON and is never unpickled.

The exit code of the child goes back to the thin worker, which exits with it (a child killed by
a signal makes the thin worker kill itself with that signal), so torchrun sees what it would
have seen from a cold worker.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import threading
import traceback

# Imported lazily by a worker's first steps (sys.modules after a tiny-llama run on CPU, beside
# `services.trainer.train`'s own imports): ~0.1 s of each restart when left to the fork.
WARM_MODULES = (
    "kernels.cpu.fused",
    "kernels.cpu.train_ops",
    "kernels.optim",
    "parallel.clip",
    "parallel.data_parallel",
    "torch.distributed.checkpoint._fsspec_filesystem",
)
MAX_REQUEST_BYTES = 8 << 20
POLL_S = 0.05
FD_COUNT = 3


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length, then JSON; stdin/stdout/stderr come with the first bytes."""
    fds = array.array("i")
    head, ancdata, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(FD_COUNT * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    received = list(fds)
    if len(head) != 4 or len(received) != FD_COUNT:
        _close_all(received)
        raise ValueError(f"expected a length and {FD_COUNT} descriptors")
    (size,) = struct.unpack("!I", head)
    if size > MAX_REQUEST_BYTES:
        _close_all(received)
        raise ValueError(f"request of {size} bytes is over {MAX_REQUEST_BYTES}")
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(size - len(body), 1 << 20))
        if not chunk:
            _close_all(received)
            raise ValueError("connection closed inside a request")
        body += chunk
    request = json.loads(body)
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if (
        not isinstance(argv, list)
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        or not isinstance(cwd, str)
    ):
        _close_all(received)
        raise ValueError("request needs argv (strings), env (string map) and cwd (string)")
    return request, received


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def _become_worker(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: take over the thin worker's descriptors and environment, train."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _close_all([fd for fd in fds if fd > 2])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        random.seed()  # a fresh interpreter's state, not the spare's (shared by every fork)
        threading.Thread(target=_die_with_client, args=(conn,), daemon=True).start()
        import torch

        if threads := request["env"].get("OMP_NUM_THREADS", "").strip():
            torch.set_num_threads(max(1, int(threads)))
        # Already in sys.modules (main() imported it before the first fork): binds the name only.
        from services.trainer.train import main

        sys.argv = ["services.trainer.train", *request["argv"]]
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            # A closed pipe must not turn into another exit code.
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {code}\n".encode())
        os._exit(code)


def _die_with_client(conn: socket.socket) -> None:
    """Blocks until the thin worker's end of the connection closes, then SIGKILLs this child."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


class Spare:
    """The accept / fork / reap loop."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.children: dict[int, tuple[socket.socket, str]] = {}
        """Live child pid -> (its connection, its LOCAL_RANK)."""

    def serve(self) -> None:
        """Forever: accept a request and fork its worker; reap children and report their end."""
        while True:
            ready, _, _ = select.select([self.listener], [], [], POLL_S)
            if ready:
                conn, _ = self.listener.accept()
                try:
                    self._start(conn)
                except (OSError, ValueError) as exc:
                    print(f"warm spare: refused a request: {exc}", file=sys.stderr, flush=True)
                    conn.close()
            self._reap()

    def _start(self, conn: socket.socket) -> None:
        if not _same_user(conn):
            raise ValueError("the peer runs as another user")
        conn.settimeout(30)
        request, fds = _recv_request(conn)
        conn.settimeout(None)
        rank = request["env"].get("LOCAL_RANK", "0")
        for pid, (_, other) in list(self.children.items()):
            if other == rank:
                os.kill(pid, signal.SIGKILL)
                self._reap(pid)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for sibling, _ in self.children.values():
                sibling.close()
            _become_worker(conn, request, fds)
        _close_all(fds)
        conn.sendall(f"pid {pid}\n".encode())
        self.children[pid] = (conn, rank)

    def _reap(self, only: int = -1) -> None:
        """Collects ended children (`only`: wait for that one) and tells their thin workers."""
        while self.children:
            pid, status = os.waitpid(only, 0 if only > 0 else os.WNOHANG)
            if pid == 0:
                return
            conn, _ = self.children.pop(pid, (None, ""))
            if conn is not None:
                if os.WIFSIGNALED(status):
                    message = f"signal {os.WTERMSIG(status)}\n"
                else:
                    message = f"exit {os.waitstatus_to_exitcode(status)}\n"
                with contextlib.suppress(OSError):
                    conn.sendall(message.encode())
                conn.close()
            if only > 0:
                return


def main(argv: list[str]) -> int:
    """Imports the training code, then serves SOCKET until terminated."""
    if len(argv) != 1:
        print("usage: python -m services.trainer.warm_spare SOCKET", file=sys.stderr)
        return 2
    import services.trainer.train  # noqa: F401  (the point: pay the imports once, before forks)

    for module in WARM_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an optional extra missing here: the fork imports it if used
            print(f"warm spare: not preloading {module}: {exc}", file=sys.stderr, flush=True)
    Spare(argv[0]).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
