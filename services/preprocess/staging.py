"""Hidden staging directories of preprocess jobs, and the cleanup of those a killed job left.

A job writes under `.{name}.partial-XXXX` next to its outputs and removes it when it ends. A job
that is killed (SIGKILL, OOM, a node lost) cannot, so each staging directory records its owner
(process id and start time) in an `.owner` file, locked (`flock`) by its job while it runs. A
directory is stale when no live job of this process owns it, nobody holds its owner lock (the
kernel drops it when the holder dies, in any process or pod sharing the volume) and its owner
process is gone (or it has no owner file and is older than this process). Stale directories are removed at service start (`sweep`) and when a job starts for the
same output (`remove_stale`); a running job's directory, here or in another process, is kept.

Every create, write, rename and delete goes through directories opened beneath the data root
(`services.common.safe_fs`): the output directory is opened once when the job stages, and the
job writes through `Stage.path` (`/proc/self/fd/N`, that very directory), so an output folder
swapped for a symlink afterwards redirects nothing and its clean-up deletes nothing outside.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common import stale_staging
from services.common.safe_fs import Dir, Escape, open_dir

logger = logging.getLogger(__name__)

OWNER_FILE = stale_staging.OWNER_FILE
# The names `create` makes: the prefix, then 8 characters of [a-z0-9_] (as `tempfile.mkdtemp`).
_STAGE_NAME = re.compile(r"\..+\.partial-[a-z0-9_]{8}")
_live: set[stale_staging.Identity] = set()
"""(device, inode) of the staging directories of this process's running jobs."""
_lock = threading.Lock()


def _live_now() -> set[stale_staging.Identity]:
    with _lock:
        return set(_live)


@dataclass
class Stage:
    """A job's staging directory, and the output directory it publishes into (both opened)."""

    output: Dir
    """The output directory, opened beneath its data root when the job staged."""
    name: str
    """The staging directory's name in `output`."""
    directory: Dir
    """The staging directory itself."""
    owner_lock: int = -1
    """The descriptor holding the exclusive lock on the owner file while the job runs."""

    @property
    def path(self) -> Path:
        """A path naming the staging directory itself (writes through it cannot be redirected)."""
        return Path(self.directory.proc_path())

    def publish(self, name: str, final_name: str | None = None) -> None:
        """Moves the staged file `name` to `final_name` (default `name`) in the output directory."""
        os.rename(name, final_name or name, src_dir_fd=self.directory.fd, dst_dir_fd=self.output.fd)

    def remove_output(self, name: str) -> None:
        """Removes the file `name` from the output directory (a link itself, never its target)."""
        self.output.unlink(name)


def create(directory: Path, name: str, roots: Sequence[Path] = ()) -> Stage:
    """A new staging directory for outputs named `name` in `directory`, owned by this process.

    `directory` is opened beneath its data root (PermissionDenied naming `output_prefix` if a
    component is a symlink); stale staging directories for `name` there are removed first.
    """
    output = open_dir(directory, roots, "output_prefix", create=True)
    try:
        remove_stale(output, name)
        for _ in range(100):
            stage_name = f".{name}.partial-{secrets.token_hex(4)}"
            try:
                os.mkdir(stage_name, 0o700, dir_fd=output.fd)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{directory}: no free staging name for {name!r}")
        stage = Stage(output, stage_name, output.subdir(stage_name))
        stage.owner_lock = stale_staging.write_owner(stage.directory)
    except BaseException:
        output.close()
        raise
    with _lock:
        _live.add(stale_staging.identity(stage.directory))
    return stage


def release(stage: Stage) -> None:
    """Removes a staging directory once its job has ended (published, failed or cancelled)."""
    with _lock:
        _live.discard(stale_staging.identity(stage.directory))
    try:
        stage.output.rmtree(stage.name)
    except (Escape, OSError) as exc:
        logger.warning("could not remove staging %s/%s: %s", stage.output.path, stage.name, exc)
    stage.directory.close()
    stage.output.close()
    if stage.owner_lock >= 0:
        os.close(stage.owner_lock)


def remove_stale(directory: Dir, name: str | None = None) -> list[str]:
    """Removes the stale staging directories for `name` (every name when None) in `directory`.

    Returns the names removed. Only this service's own staging names (`.{name}.partial-XXXXXXXX`)
    are candidates, and a symlink with such a name is left alone.
    """
    pattern = re.compile(rf"\.{re.escape(name)}\.partial-[a-z0-9_]{{8}}") if name else _STAGE_NAME
    return stale_staging.remove_stale(directory, pattern, _live_now(), "preprocess job")


def sweep(roots: Sequence[Path], max_depth: int = 4, max_dirs: int = 20_000) -> list[Path]:
    """`remove_stale` in every directory under `roots` down to `max_depth` (service start)."""
    return stale_staging.sweep(roots, _STAGE_NAME, _live_now, "preprocess job", max_depth, max_dirs)
