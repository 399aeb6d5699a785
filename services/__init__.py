"""Meshline's services and their command lines.

Importing this package, which every service entry point (`meshline`, `python -m
services.<name>`, the trainer's worker processes) does before any module loads torch, sets
OMP_WAIT_POLICY=PASSIVE unless the user set it or GOMP_SPINCOUNT: OpenMP threads then sleep at
a barrier instead of spinning, which on a CPU shared with other work cost served decode up to
~80x (kernels/cpu/threads.py, docs/kernels.md). Inline rather than imported: any module of
`kernels` loads torch first, and light commands (`meshline --help`, the clients) load no torch.
Worker processes inherit it through the environment.
"""

import os as _os

if not (
    _os.environ.get("OMP_WAIT_POLICY", "").strip() or _os.environ.get("GOMP_SPINCOUNT", "").strip()
):
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # kernels.cpu.threads.DEFAULT_WAIT_POLICY
