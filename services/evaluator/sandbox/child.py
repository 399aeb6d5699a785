"""The interpreter-side harness: `python -I -S child.py CONFIG_JSON`, already inside the sandbox.

`launcher.py` execs this after the namespaces, the read-only root, the unprivileged uid, the
rlimits, no_new_privs and seccomp are in place, so nothing here is a security boundary: the
untrusted code runs in this same interpreter and may do anything to it. There is no secret in
this process to steal. Roles (CONFIG_JSON's "role"):

- "program": run one program; exit 0 and write b"done" to fd 3 if it ran to its end.
- "serve": run the candidate's source (prompt + completion), then answer calls of its entry
  point read from fd 3 (`wire` messages), one reply each on fd 4, until fd 3 ends.
- "check": run the prompt (helpers such as HumanEval's `poly`) and the test code with the
  entry point replaced by a proxy that forwards each call to the "serve" process, then
  `check(candidate)`; exit 0 only if it returned. The completion never runs in this process,
  so its exit status - which the parent reads - is the verdict.

Imports nothing from Meshline.
"""

import builtins
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire

# Builtin exception types a candidate's error may come back as (anything else: RuntimeError;
# SystemExit, KeyboardInterrupt and GeneratorExit are not Exceptions).
_RERAISE = {
    name: value
    for name, value in vars(builtins).items()
    if isinstance(value, type)
    and issubclass(value, Exception)
    and not issubclass(value, (StopIteration, StopAsyncIteration))  # would end a test's loop early
}


def _run_source(path, namespace):
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    exec(compile(source, os.path.basename(path), "exec"), namespace)


def _fail(exc, prefix=""):
    sys.stdout.flush()
    sys.stderr.write(f"{prefix}{type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    os._exit(1)


def run_program(config):
    """The whole program; the marker on fd 3 says it reached its end (the program could forge it:
    only use this verdict for programs that do not try to)."""
    try:
        _run_source(config["program"], {"__name__": "__main__", "__builtins__": builtins})
    except BaseException as exc:  # SystemExit too: leaving early is not passing
        _fail(exc)
    sys.stdout.flush()
    os.write(3, b"done")
    os._exit(0)


def serve(config):
    """Run the candidate, then answer calls of its entry point until the checker hangs up."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _run_source(config["program"], namespace)
        function = namespace[config["entry_point"]]
    except BaseException as exc:
        _fail(exc, "completion: ")
    requests, replies = os.fdopen(3, "rb"), os.fdopen(4, "wb", buffering=0)
    while True:
        try:
            message = wire.read_message(requests)
        except EOFError:
            os._exit(0)
        args, kwargs = (wire.decode(part) for part in message["call"])
        try:
            reply = {"ok": wire.encode(function(*args, **kwargs))}
        except BaseException as exc:  # the checker sees it as the call's exception
            reply = {"error": [type(exc).__name__, str(exc)[:1000]]}
        sys.stdout.flush()
        replies.write(wire.dumps(reply))


def check(config):
    """The test code against a proxy of the candidate; exits 0 only when `check` returned."""
    replies, requests = os.fdopen(3, "rb"), os.fdopen(4, "wb", buffering=0)

    def candidate(*args, **kwargs):
        requests.write(wire.dumps({"call": [wire.encode(list(args)), wire.encode(kwargs)]}))
        try:
            message = wire.read_message(replies)
        except EOFError:
            raise RuntimeError("the completion's process ended (see its error)") from None
        if "error" in message:
            name, text = message["error"]
            raise _RERAISE.get(name, RuntimeError)(f"{name} in the completion: {text}")
        return wire.decode(message["ok"])

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _run_source(config["prompt"], namespace)
        namespace[config["entry_point"]] = candidate
        _run_source(config["test"], namespace)
        namespace["check"](candidate)
    except BaseException as exc:
        _fail(exc)
    sys.stdout.flush()
    os._exit(0)


# Only when the launcher could not exec the interpreter as the run's uid (no namespaces, root,
# an interpreter under a private home): what HumanEval code imports, loaded before the drop.
PRELOAD = (
    "typing", "math", "re", "collections", "itertools", "functools", "heapq", "bisect",
    "string", "hashlib", "random", "statistics", "fractions", "decimal", "copy", "operator",
    "datetime", "array", "numbers", "dataclasses", "enum", "abc", "textwrap", "cmath",
    "unicodedata", "struct", "time", "queue", "contextlib", "io", "inspect", "traceback",
)  # fmt: skip


def drop_privileges(uid):
    """Unsafe mode as root only: preload, then become the run's own uid before any program."""
    for module in PRELOAD:
        __import__(module)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def main():
    config = json.loads(sys.argv[1])
    if config.get("uid") is not None:
        drop_privileges(config["uid"])
    {"program": run_program, "serve": serve, "check": check}[config["role"]](config)


if __name__ == "__main__":
    main()
