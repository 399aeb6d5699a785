"""Start, confine, time and reap the processes of one sandbox run: `python -I -S launcher.py DIR`.

Trusted. The runner writes DIR/config.json and the sources; this process (fresh and
single-threaded, unlike the service that spawned it) forks one supervisor per role. Isolated,
a supervisor enters new user (when not root), PID, mount, network, IPC and UTS namespaces and
forks the role's process, PID 1 of its namespace, which builds its root
(`namespaces.build_root`), starts a session of its own, sets the rlimits, drops to the run's
own uid (when root), sets no_new_privs and seccomp, and execs `child.py`. Killing a PID 1
kills its whole namespace, so nothing outlives the run. The verdict role's exit status and the
others' are written as JSON to stdout; nothing the sandboxed programs print is read here.
"""

import contextlib
import json
import os
import resource
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import namespaces

HARNESS = ("child.py", "wire.py")


class _Timeout(Exception):
    pass


def _limits(config):
    cpu, memory = int(config["cpu_seconds"]), int(config["memory_bytes"])
    size, procs = int(config["file_size_bytes"]), int(config["max_processes"])
    files = int(config["open_files"])
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_DATA, (memory, memory)), (resource.RLIMIT_FSIZE, (size, size)),
        (resource.RLIMIT_NPROC, (procs, procs)), (resource.RLIMIT_NOFILE, (files, files)),
        (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_MEMLOCK, (0, 0)),
    ):  # fmt: skip
        resource.setrlimit(limit, value)


def _exec_role(config, role, fds):
    """PID 1 of the role's namespaces (or a plain child when not isolated): confine, then exec."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    here = os.path.dirname(os.path.abspath(__file__))
    harness = {}
    for name in HARNESS:
        with open(os.path.join(here, name), encoding="utf-8") as fh:
            harness[f"/sandbox/{name}"] = fh.read()
    uid = role.get("uid")
    seccomp = namespaces.load_seccomp() if config["seccomp"] else None
    if config["isolate"]:
        files = {**harness, **{f"/sandbox/{k}": v for k, v in role["files"].items()}}
        namespaces.build_root(
            role["root"], config["expose"], files, uid, int(config["file_size_bytes"]) * 4
        )
        sandbox, workdir = "/sandbox", "/work"
    else:
        sandbox, workdir = role["sandbox"], role["workdir"]
    os.setsid()  # kill(0, ...) and killpg reach this run's processes only
    high = [os.dup2(fd, 1000 + i) for i, fd in enumerate(fds)]  # out of the targets' way
    for target, fd in enumerate(high):
        os.dup2(fd, target)  # inheritable
    os.closerange(len(fds), 1 << 16)
    _limits(config)
    argv = dict(role["argv"])
    if uid is not None and not config["isolate"] and not _world_readable(config["python"]):
        argv["uid"] = uid  # e.g. a pyenv under /root: child.py imports, then drops (see there)
    elif uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    namespaces.prctl(namespaces.PR_SET_PDEATHSIG, signal.SIGKILL)
    namespaces.prctl(namespaces.PR_SET_NO_NEW_PRIVS, 1)
    if seccomp is not None:
        try:
            namespaces.install_seccomp(seccomp)
        except OSError:
            if config["isolate"]:
                raise  # isolated runs always have it; unsafe ones take what the host allows
    os.chdir(workdir)
    named = ("program", "prompt", "test")
    argv = {k: (f"{sandbox}/{v}" if k in named else v) for k, v in argv.items()}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    python = config["python"]
    os.execve(python, [python, "-I", "-S", f"{sandbox}/child.py", json.dumps(argv)], env)


def _world_readable(python):
    """Whether another uid can reach the interpreter and its stdlib (every parent o+x)."""
    path = os.path.dirname(os.path.dirname(python))  # the installation prefix
    while path not in ("/", ""):
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.dirname(path)
    return True


def _supervise(config, role, fds):
    """The role's supervisor: enter the namespaces, fork PID 1, relay its end, kill it on TERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        if config["isolate"]:
            if os.geteuid() != 0:
                namespaces.unshare(namespaces.CLONE_NEWUSER)
                namespaces.map_own_ids()
            namespaces.unshare(
                namespaces.CLONE_NEWPID | namespaces.CLONE_NEWNS | namespaces.CLONE_NEWNET
                | namespaces.CLONE_NEWIPC | namespaces.CLONE_NEWUTS
            )  # fmt: skip
        pid = os.fork()
        if pid == 0:
            try:
                _exec_role(config, role, fds)
            except BaseException as exc:  # setup failed: say why on the role's stderr
                _say(fds[2], f"sandbox setup: {type(exc).__name__}: {exc}\n")
            os._exit(125)
    except BaseException as exc:
        os.write(fds[2], f"sandbox setup: {type(exc).__name__}: {exc}\n".encode())
        os._exit(125)
    os.closerange(3, 1 << 16)  # no pipe end stays open here (its reader would miss EOF)

    def stop(signum, frame):
        _kill(pid, pgroup=not config["isolate"])

    signal.signal(signal.SIGTERM, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    status = _wait(pid)
    _kill(pid, pgroup=not config["isolate"])  # PID 1 gone: the kernel kills the namespace
    os._exit(status)


def _say(fd, text):
    for target in (fd, 2):  # the role's stderr, moved to 2 once the fds are in place
        try:
            os.write(target, text.encode())
            return
        except OSError:
            continue


def _wait(pid):
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 125
        if os.WIFEXITED(status):
            return os.WEXITSTATUS(status)
        if os.WIFSIGNALED(status):
            return 128 + os.WTERMSIG(status)


def _kill(pid, pgroup):
    for kill in (os.killpg, os.kill) if pgroup else (os.kill,):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _kill_uids(uids):
    """Root without namespaces: every process left of the run's own uids."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in uids:
                    os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue


def _fds(config, role, channels):
    out = os.open(role["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(role["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return [os.open(os.devnull, os.O_RDONLY), out, err, *channels]


def main():
    directory = sys.argv[1]
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    roles = config["roles"]
    if len(roles) == 2:  # serve + check: requests checker -> candidate, replies back
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        channels = {"serve": [req_r, rep_w], "check": [rep_r, req_w]}
        marker_r = None
    else:
        marker_r, marker_w = os.pipe()
        channels = {roles[0]["name"]: [marker_w]}
    supervisors = {}
    for role in roles:
        fds = _fds(config, role, channels[role["name"]])
        pid = os.fork()
        if pid == 0:
            _supervise(config, role, fds)
        supervisors[pid] = role["name"]
        for fd in set(fds):  # the role's pipe ends included: only its processes hold them
            os.close(fd)
    verdict = next(pid for pid, name in supervisors.items() if name == config["verdict_role"])
    ended, timed_out = {}, False

    def alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, float(config["timeout_s"]))
    try:
        while verdict not in ended:
            pid, status = os.waitpid(-1, 0)
            if pid in supervisors:
                ended[pid] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128
    except _Timeout:
        timed_out = True
    signal.setitimer(signal.ITIMER_REAL, 0)
    _stop(supervisors, ended)
    if config["isolate"] is False and config.get("uids"):
        _kill_uids(set(config["uids"]))
    marker = b""
    if marker_r is not None:
        os.set_blocking(marker_r, False)
        with contextlib.suppress(BlockingIOError):
            marker = os.read(marker_r, 16)
    codes = {name: ended.get(pid) for pid, name in supervisors.items()}
    report = {"timeout": timed_out, "exit": codes, "marker": marker == b"done"}
    sys.stdout.write(json.dumps(report) + "\n")


def _stop(supervisors, ended):
    """SIGTERM every supervisor still running (each kills its namespace), then reap them all."""
    alive = [pid for pid in supervisors if pid not in ended]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    for pid in alive:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended[pid] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ended[pid] = 128 + signal.SIGKILL
                break
            time.sleep(0.005)


if __name__ == "__main__":
    main()
