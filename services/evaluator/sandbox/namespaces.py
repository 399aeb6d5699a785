"""Kernel isolation for one sandboxed process: namespaces, a minimal read-only root, seccomp.

Trusted code, used only by `launcher.py` in a fresh single-threaded process before the
untrusted program's interpreter is exec'd (nothing here runs in the same image as untrusted
code). Python 3.11 has no `os.unshare`/`mount`, so the syscalls go through ctypes. Imports
nothing from Meshline: the launcher runs as a script with `python -I -S`.
"""

import contextlib
import ctypes
import ctypes.util
import os
import socket

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, -1)
"""pivot_root(2) has no glibc wrapper before 2.36; -1 elsewhere (the probe then fails)."""
# Flags a remount must keep when the kernel locked them (always the case in a user namespace).
_LOCKED = (
    (os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)  # fmt: skip
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
"""Host directories the sandbox sees, read-only (system libraries and tools; no data)."""
DEVICES = ("null", "zero", "random", "urandom")
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "keyctl", "add_key",
    "request_key", "bpf", "perf_event_open", "userfaultfd", "mount", "umount2", "pivot_root",
    "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "swapon", "swapoff", "reboot",
    "syslog", "acct", "quotactl", "name_to_handle_at", "open_by_handle_at", "lookup_dcookie",
    "personality", "uselib", "vhangup",
)  # fmt: skip
"""Refused with EPERM by the seccomp filter (defence in depth: none is needed by Python code,
most already fail without capabilities; ptrace and process_vm_* would reach other processes of
the same uid, io_uring bypasses seccomp)."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags):
    """unshare(2)."""
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source, target, fstype, flags, data=None):
    """mount(2)."""
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def prctl(option, arg):
    """prctl(2) with one argument."""
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def map_own_ids():
    """In a new user namespace: map our own uid/gid to themselves (needs no privilege)."""
    uid, gid = os.geteuid(), os.getegid()
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):  # fmt: skip
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)


def _bind_readonly(source, target):
    mount(source, target, None, MS_BIND | MS_REC)
    locked = os.statvfs(source).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(ms for st, ms in _LOCKED if locked & st)
    mount(None, target, None, flags)


def _replicate(path, root):
    """Makes `path` of the host exist under `root`: a symlink as a symlink, a directory bound."""
    inside = root + path
    os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), inside)
    elif os.path.isdir(path):
        os.makedirs(inside, mode=0o755, exist_ok=True)
        _bind_readonly(path, inside)


def build_root(root, extra_dirs, files, work_owner, work_bytes):
    """Turns the (empty) directory `root` into the sandbox's whole filesystem and enters it.

    A tmpfs holding: SYSTEM_DIRS and `extra_dirs` (the interpreter) bound read-only, a few
    device nodes, /proc of the new PID namespace, `files` ({path: text}, read-only), a private
    writable /work (`work_bytes`, owned by `work_owner`) and /tmp. The old root is detached, so
    nothing else of the host (data roots, home directories, secrets, sockets) is reachable.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    for path in SYSTEM_DIRS:
        if os.path.lexists(path):
            _replicate(path, root)
    for path in extra_dirs:
        if not os.path.exists(root + path):
            _replicate(path, root)
    os.makedirs(root + "/dev", mode=0o755)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "w").close()
            mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for path, text in files.items():
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        with open(root + path, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(root + path, 0o644)
    for path, size in (("/work", work_bytes), ("/tmp", 1 << 20)):
        os.makedirs(root + path, mode=0o755)
        mount("sandbox", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={size}")
        if work_owner is not None:
            os.chown(root + path, work_owner, work_owner)
    os.makedirs(root + "/proc", mode=0o555)
    # A container that masks parts of /proc refuses a new one; Python needs none.
    with contextlib.suppress(OSError):
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    socket.sethostname("sandbox")


def load_seccomp():
    """libseccomp, loaded while the host's library paths are still visible; None if missing."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        name = ctypes.util.find_library("seccomp")
        if name is None:
            return None
        lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


def install_seccomp(lib):
    """Loads a filter refusing DENIED_SYSCALLS with EPERM (after no_new_privs)."""
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    if not ctx:
        raise OSError("seccomp_init failed")
    refuse = 0x00050000 | 1  # SCMP_ACT_ERRNO(EPERM)
    for syscall in DENIED_SYSCALLS:
        number = lib.seccomp_syscall_resolve_name(syscall.encode())
        if number >= 0:
            _check(lib.seccomp_rule_add(ctx, refuse, number, 0), f"seccomp rule {syscall}")
    _check(lib.seccomp_load(ctx), "seccomp_load")
