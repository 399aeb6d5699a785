"""`python -m services.common.die_with_parent PARENT_PID TOKEN -- CMD...`: exec CMD so that it
gets SIGTERM when its parent dies.

Sets `prctl(PR_SET_PDEATHSIG, SIGTERM)` (kept across exec), then checks the parent is still
PARENT_PID (it may have died before the prctl, in which case the signal would never come), marks
the environment with the job token (`job_processes.JOB_TOKEN_ENV`) and execs CMD in place. Linux
only; elsewhere CMD runs without the death signal and the restart sweep is the only guard.
"""

from __future__ import annotations

import os
import sys

from services.common.job_processes import JOB_TOKEN_ENV, die_with_parent_here


def main(argv: list[str]) -> int:
    """Parses `PARENT_PID TOKEN -- CMD...`, arms the death signal and execs CMD."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: die_with_parent PARENT_PID TOKEN -- CMD...", file=sys.stderr)
        return 2
    parent, token, command = int(argv[0]), argv[1], argv[3:]
    if not die_with_parent_here(parent):
        print(f"parent {parent} is gone; not starting {command[0]}", file=sys.stderr)
        return 1
    os.environ[JOB_TOKEN_ENV] = token
    os.execvp(command[0], command)
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
