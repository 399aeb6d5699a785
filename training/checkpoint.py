"""Native checkpoints: `save_dir/step-000123/` in DCP format plus JSON state, and a `latest` file.

A step is written into `step-000123.tmp/` by every rank, then rank 0 renames it to `step-000123/`
and replaces `latest` (which holds the step number) with `os.replace` — so a directory without
`.tmp` is always complete and `latest` always names a complete step. Stale `.tmp` directories
(from a crash) are removed by the next save. Layout of a step directory:

    .metadata, __<rank>_<n>.distcp   DCP: model.<fqn>, optim.state.<fqn>.<key> (global names)
    train_state.json                 step, world size, extra counters, scheduler, loss scaler,
                                     optimizer param-group hyper-parameters, and which of the
                                     optimizer and RNG states were saved (--no-save-optim/-rng)
    rng/rank-00000.json              each rank's Python/NumPy/torch/device RNG state
    config.json, tokenizer/          model config and tokenizer files, for convert and serve
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checkpoints.native_format import FORMAT
from checkpoints.safe_fs import open_dir_beneath
from checkpoints.safe_reader import SafeFileSystemReader
from training.ckpt.signals import LastGasp
from training.ckpt.state import (
    TrainState,
    model_optimizer_state,
    restore_tuples,
    rng_state_from_json,
    rng_state_to_json,
    set_model_optimizer_state,
    split_tensors,
    to_json_safe,
)

__all__ = ["CheckpointManager", "LastGasp", "TrainState"]

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


PathGuard = Callable[[Path, str], object]
"""Re-checks a path right before it is written (raising to refuse it); the service passes
`services.common.paths.check_at_use`, which refuses a directory swapped for a symlink."""


def _write_json(path: Path, payload: Any) -> None:
    """Write JSON to `path` atomically beneath its data root (`checkpoints.safe_fs`: the folder
    is opened without following a link swapped in, then written through a temporary name)."""
    with open_dir_beneath(path.parent) as folder:
        folder.write_text(path.name, json.dumps(payload, indent=1, sort_keys=True))


class CheckpointManager:
    """Save, load and prune native checkpoints under `save_dir` (see the module doc).

    Construct it on every rank (it may create a process group for async saves). `keep_last`
    > 0 keeps that many most recent steps; `async_save` writes DCP files in a background thread
    on a dedicated gloo group, after copying the state to host memory, so training continues.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        keep_last: int = 0,
        async_save: bool = False,
        model_config: dict[str, Any] | None = None,
        tokenizer_files: Sequence[str | os.PathLike[str]] = (),
        path_guard: PathGuard | None = None,
    ):
        if keep_last < 0:
            raise ValueError(f"--keep-last-checkpoints must be >= 0 (0 keeps all), got {keep_last}")
        self.save_dir = Path(save_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self.model_config = model_config
        self.tokenizer_files = [Path(p) for p in tokenizer_files]
        for path in self.tokenizer_files:
            if not path.is_file():
                raise FileNotFoundError(f"tokenizer file {path} does not exist")
        self._group = dist.new_group(backend="gloo") if async_save and _dist() else None
        self._pending: Future | None = None
        self._pending_error: BaseException | None = None
        self._published = threading.Event()
        self.path_guard = path_guard
        if _rank() == 0:
            self._guard(self.save_dir)
            self.save_dir.mkdir(parents=True, exist_ok=True)

    def _guard(self, path: Path) -> None:
        if self.path_guard is not None:
            self.path_guard(path, "checkpoint directory")

    # -- layout -----------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        """The directory of a complete `step`."""
        return step_path(self.save_dir, step)

    def steps(self) -> list[int]:
        """Complete steps on disk, oldest first (`.tmp` directories do not count)."""
        if not self.save_dir.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.save_dir.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int | None:
        """The step `latest` names, or None when nothing was saved yet."""
        return read_latest(self.save_dir)

    # -- save -------------------------------------------------------------------------------

    def save(self, step: int, state: TrainState | Callable[[], TrainState]) -> Path:
        """Write checkpoint `step` (every rank calls it); returns the final step directory.

        With `async_save` the DCP write continues in the background and the directory appears
        (and `latest` moves) when it finishes; call `wait()` before exiting.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.wait()
        train_state = state() if callable(state) else state
        tmp = self.save_dir / f"step-{step:06d}.tmp"
        if _rank() == 0:
            # Under a service: the directory may have become a symlink since the request.
            self._guard(self.save_dir)
            self._remove_stale_tmp()
            tmp.mkdir(parents=True)
        self._barrier()
        model_sd, optim_sd = model_optimizer_state(train_state)
        optim_tensors, optim_plain = split_tensors(optim_sd)
        self._write_side_files(tmp, step, train_state, optim_plain)
        tensors = {"model": model_sd, "optim": optim_tensors}
        if self.async_save:
            response = dcp.async_save(
                tensors, checkpoint_id=tmp, process_group=self._group, no_dist=not _dist()
            )
            # Newer DCP may answer with an AsyncSaveResponse whose upload_completion is the future.
            future = cast(Future, getattr(response, "upload_completion", response))
            self._pending = future
            self._published.clear()
            future.add_done_callback(lambda done: self._finish_async(done, step, tmp))
        else:
            dcp.save(tensors, checkpoint_id=tmp, no_dist=not _dist())
            self._barrier()
            self._finalize(step, tmp)
            self._barrier()
        return self.step_dir(step)

    def _write_side_files(
        self, tmp: Path, step: int, state: TrainState, optim_plain: dict[str, Any]
    ) -> None:
        if state.save_rng:
            (tmp / "rng").mkdir(exist_ok=True)
            _write_json(tmp / "rng" / f"rank-{_rank():05d}.json", rng_state_to_json())
        if _rank() != 0:
            return
        payload = {
            "format": FORMAT,
            "step": step,
            "world_size": dist.get_world_size() if _dist() else 1,
            "extra": to_json_safe(state.extra, "extra"),
            "optimizer_param_groups": optim_plain,
            "scheduler": _component_state(state.scheduler, "scheduler"),
            "loss_scaler": _component_state(state.loss_scaler, "loss_scaler"),
            "saved": {"optimizer": state.optimizer is not None, "rng": state.save_rng},
        }
        _write_json(tmp / "train_state.json", payload)
        if self.model_config is not None:
            _write_json(tmp / "config.json", to_json_safe(self.model_config, "model_config"))
        if self.tokenizer_files:
            (tmp / "tokenizer").mkdir()
            for path in self.tokenizer_files:
                shutil.copy2(path, tmp / "tokenizer" / path.name)

    def _finalize(self, step: int, tmp: Path) -> None:
        """Rank 0: publish `tmp` as the complete step, move `latest`, prune old steps."""
        if _rank() != 0:
            return
        self._guard(tmp)
        final = self.step_dir(step)
        # Every rename, the pointer and pruning go through the save folder opened beneath its
        # data root: a folder swapped for a symlink meanwhile is refused, nothing outside moves.
        with open_dir_beneath(self.save_dir) as save:
            if save.lstat(final.name) is not None:
                # Re-saving a step (e.g. a last-gasp save right after a resume): swap, never merge.
                old = final.name + ".old"
                save.rmtree(old)
                save.rename(final.name, old)
                save.rename(tmp.name, final.name)
                save.rmtree(old)
            else:
                save.rename(tmp.name, final.name)
            save.write_text("latest", f"{step}\n")
            if self.keep_last:
                for old_step in self.steps()[: -self.keep_last]:
                    if old_step != step:
                        save.rmtree(self.step_dir(old_step).name)
        log.info("saved checkpoint %s", final)

    def _finish_async(self, done: Future, step: int, tmp: Path) -> None:
        try:
            done.result()
            self._finalize(step, tmp)
        except BaseException as exc:  # surfaced by wait(), on the training thread
            self._pending_error = exc
        finally:
            # Future.result() returns before done-callbacks finish: wait() waits for this instead.
            self._published.set()

    def wait(self) -> None:
        """Block until a pending async save is published; re-raise its error if it failed."""
        if self._pending is not None:
            self._pending = None
            self._published.wait()
            error, self._pending_error = self._pending_error, None
            if error is not None:
                raise RuntimeError(f"async checkpoint save under {self.save_dir} failed") from error
            self._barrier()

    def _remove_stale_tmp(self) -> None:
        for path in self.save_dir.glob("step-*.tmp"):
            log.warning("removing incomplete checkpoint %s (left by an interrupted save)", path)
            shutil.rmtree(path, ignore_errors=True)

    def _barrier(self) -> None:
        if _dist():
            dist.barrier()

    # -- load -------------------------------------------------------------------------------

    def load(self, step: int | str, state: TrainState) -> int:
        """Restore `state` in place from `step` (a number or "latest"); returns the step loaded.

        Works across layouts: any DP size or ZeRO stage loads any other. RNG states are restored
        per rank when the saved job had this rank; otherwise rank 0's state is used (a warning).
        """
        step = self._resolve(step)
        path = self.step_dir(step)
        meta = self._read_train_state(path)
        check_resumable(meta, path, optimizer=state.optimizer is not None, rng=state.save_rng)
        model_sd, optim_sd = model_optimizer_state(state)
        optim_tensors, _ = split_tensors(optim_sd)
        tensors = {"model": model_sd, "optim": optim_tensors}
        reader = SafeFileSystemReader(path)
        reader.read_metadata()  # fail here, with the file named, on missing/corrupted metadata
        try:
            dcp.load(tensors, storage_reader=reader, no_dist=not _dist())
        except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
            raise RuntimeError(
                f"checkpoint {path} could not be loaded into this model/optimizer ({exc}); check "
                f"that the model config matches {path / 'config.json'}"
            ) from exc
        for key, value in meta["optimizer_param_groups"].items():
            optim_sd[key] = restore_tuples(value, optim_sd.get(key))
        optim_sd.update(optim_tensors)
        set_model_optimizer_state(state, tensors["model"], optim_sd)
        _load_component(state.scheduler, meta.get("scheduler"), "scheduler", path)
        _load_component(state.loss_scaler, meta.get("loss_scaler"), "loss_scaler", path)
        state.extra.clear()
        state.extra.update(meta["extra"])
        if state.save_rng:
            self._load_rng(path, meta)
        self._barrier()
        return step

    def _resolve(self, step: int | str) -> int:
        if step == "latest":
            found = self.latest()
            if found is None:
                raise FileNotFoundError(
                    f"no checkpoint to resume from: {self.save_dir / 'latest'} does not exist "
                    f"(train without --load, or point --load at a directory with a saved step)"
                )
            return found
        if isinstance(step, int) and step >= 0:
            return step
        raise ValueError(f"checkpoint step must be a step number or 'latest', got {step!r}")

    def _read_train_state(self, path: Path) -> dict[str, Any]:
        if not path.is_dir():
            have = ", ".join(str(s) for s in self.steps()) or "none"
            raise FileNotFoundError(f"checkpoint {path} does not exist (complete steps: {have})")
        meta_path = path / "train_state.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{meta_path} is missing: {path} is not a complete checkpoint"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path} is corrupted ({exc})") from exc
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} has format {meta.get('format')!r}; expected {FORMAT!r}")
        return meta

    def _load_rng(self, path: Path, meta: dict[str, Any]) -> None:
        rng_path = path / "rng" / f"rank-{_rank():05d}.json"
        if not rng_path.is_file():
            log.warning(
                "%s has no RNG state for rank %d (saved with %d ranks); using rank 0's",
                path,
                _rank(),
                meta["world_size"],
            )
            rng_path = path / "rng" / "rank-00000.json"
        if rng_path.is_file():
            rng_state_from_json(json.loads(rng_path.read_text()))


def step_path(save_dir: Path, step: int) -> Path:
    """The directory of complete step `step` under `save_dir`."""
    return save_dir / f"step-{step:06d}"


def read_latest(save_dir: Path) -> int | None:
    """The step `save_dir`'s `latest` names, or None when nothing was saved yet."""
    pointer = save_dir / "latest"
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} should hold a step number, found {text[:40]!r}")
    return int(text)


def latest_train_state(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(step directory, its train_state.json) of the step `directory`'s `latest` names, read
    without a manager (no directory is created), or None where that cannot be read (the load
    itself then reports it)."""
    try:
        step = read_latest(Path(directory))
        if step is None:
            return None
        path = step_path(Path(directory), step)
        return path, json.loads((path / "train_state.json").read_text())
    except (OSError, ValueError):
        return None


def check_resumable(meta: dict[str, Any], path: Path, *, optimizer: bool, rng: bool) -> None:
    """ValueError naming the flag to add when a load asks for the optimizer or RNG state and the
    checkpoint was saved without it (--no-save-optim, --no-save-rng; older checkpoints have
    both)."""
    saved = meta.get("saved", {})
    if optimizer and not saved.get("optimizer", True):
        raise ValueError(
            f"checkpoint {path} holds no optimizer state (saved with --no-save-optim): pass "
            "--no-load-optim to start a fresh optimizer, or --finetune to load the weights only"
        )
    if rng and not saved.get("rng", True):
        raise ValueError(
            f"checkpoint {path} holds no RNG state (saved with --no-save-rng): pass "
            "--no-load-rng, or --finetune to load the weights only"
        )


def _component_state(component: Any, name: str) -> Any:
    if component is None:
        return None
    return to_json_safe(component.state_dict(), name)


def _load_component(component: Any, saved: Any, name: str, path: Path) -> None:
    if component is None:
        return
    if saved is None:
        raise ValueError(f"{path} holds no {name} state, but this run has a {name} to restore")
    live = component.state_dict()
    component.load_state_dict({k: restore_tuples(v, live.get(k)) for k, v in saved.items()})
