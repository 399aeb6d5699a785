"""Meshline native checkpoints: the trainer's DCP layout (written by training/checkpoint.py).

`save_dir/latest` names a step; `step-XXXXXX/` holds DCP files with `model.<fqn>` tensors under
global names, `train_state.json`, `config.json` (a ModelConfig dict) and `tokenizer/`. A
converted checkpoint carries weights only (no optimizer state, scheduler or RNG): it loads with
`CheckpointManager.load` into any parallel layout, and training from it starts a new run.

Reading loads one unit's keys per `dcp.load` call (DCP reads only the requested items).
Writing plans the whole state on meta tensors and lets DCP pull each tensor from the converter
as it writes it (`_PullPlanner.resolve_data`), so one unit at a time is in memory.
"""

from __future__ import annotations

import json
import queue
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoints.bounds import check_declared_size
from checkpoints.safe_reader import SafeFileSystemReader
from checkpoints.units import PRE, Tensors, Unit, expected_shapes, reconcile, unit_of
from models.config import ModelConfig
from models.value_head import value_head_config

FORMAT = "meshline-dcp-1"
"""The `format` value in a native step's train_state.json (written by the trainer's CheckpointManager)."""
_PREFIX = "model."


def find_step(directory: Path) -> Path:
    """The step directory a native checkpoint path means (`latest` for a save directory)."""
    if (directory / ".metadata").is_file():
        return directory
    pointer = directory / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(
            f"{directory} is not a native checkpoint: it has neither a DCP .metadata nor a "
            "`latest` file (point --load-dir at the trainer's --save directory or a step-XXXXXX)"
        )
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} should hold a step number, found {text[:40]!r}")
    step = directory / f"step-{int(text):06d}"
    if not step.is_dir():
        raise FileNotFoundError(f"{pointer} names step {text}, but {step} does not exist")
    return step


class NativeSource:
    """A native step directory opened for per-unit reads."""

    def __init__(self, directory: Path, config: ModelConfig | None = None) -> None:
        self.step_dir = find_step(directory)
        config_path = self.step_dir / "config.json"
        if config_path.is_file():
            try:
                own = ModelConfig.from_dict(json.loads(config_path.read_text()))
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
                raise ValueError(f"{config_path} is corrupted ({exc})") from exc
            except ValueError as exc:
                raise ValueError(f"{config_path}: {exc}") from exc
            config = reconcile(own, config, str(config_path))
        elif config is None:
            raise FileNotFoundError(f"{config_path} is missing; pass --model NAME")
        self.config = config
        self._saved_config = config  # a PPO run's: the policy's (its critic's is derived)
        tokenizer = self.step_dir / "tokenizer"
        self.tokenizer_files = sorted(tokenizer.iterdir()) if tokenizer.is_dir() else []
        self.iteration = int(self.step_dir.name.rpartition("-")[2] or 0)
        self._reader_path = self.step_dir
        metadata = SafeFileSystemReader(self.step_dir).read_metadata()
        check_declared_size(
            config,
            {self.step_dir / info.relative_path for info in metadata.storage_data.values()},
            str(self.step_dir),
        )
        self._items = metadata.state_dict_metadata
        self._prefix = _model_prefix(self._items)
        """Where the model's tensors are: `model.`, or a PPO run's policy under `model.policy.`
        (its critic under `model.critic.` after `select_ppo_model("critic")`)."""
        self._meta: dict[str, TensorStorageMetadata] = {}
        self._collect()

    @property
    def is_ppo(self) -> bool:
        """Whether this is a `--stage ppo` checkpoint (a policy and a critic side by side)."""
        return self._prefix in (_PPO_POLICY, _PPO_CRITIC)

    def select_ppo_model(self, part: str) -> None:
        """Read the PPO run's `policy` (the default) or its `critic`: the value model, a copy
        of the policy's network whose vocabulary head is a scalar value head, so it converts as
        a reward model does (HF: `...ForSequenceClassification`, one label)."""
        if not self.is_ppo:
            raise ValueError(
                f"--ppo-model {part}: {self.step_dir} is not a --stage ppo checkpoint (it holds "
                "no policy and critic side by side); drop --ppo-model"
            )
        if part not in PPO_MODELS:
            raise ValueError(f"--ppo-model {part!r}: choose one of {list(PPO_MODELS)}")
        wanted = _PPO_CRITIC if part == "critic" else _PPO_POLICY
        if wanted == self._prefix:
            return
        policy = self._saved_config
        self.config = value_head_config(policy) if part == "critic" else policy
        self._prefix = wanted
        self._collect()

    def _collect(self) -> None:
        self._meta = {
            key.removeprefix(self._prefix): item
            for key, item in self._items.items()
            if key.startswith(self._prefix) and isinstance(item, TensorStorageMetadata)
        }
        self._check_shapes()

    def _check_shapes(self) -> None:
        for name, shape in expected_shapes(self.config).items():
            item = self._meta.get(name)
            if item is None:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(
                    f"{self.step_dir}: no tensor {self._prefix}{name}; the checkpoint does not hold "
                    "this model (check --model / config.json)"
                )
            if tuple(item.size) != tuple(shape):
                raise ValueError(
                    f"{self.step_dir}: {self._prefix}{name} has shape {tuple(item.size)}, the model "
                    f"config needs {tuple(shape)} (check --model / config.json)"
                )

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors, read from the DCP files (only their bytes)."""
        names = [
            n
            for n in self._meta
            if unit_of(n) == unit
            and not (n == "lm_head.weight" and self.config.tie_word_embeddings)
        ]
        state = {
            self._prefix + n: torch.empty(
                tuple(self._meta[n].size), dtype=self._meta[n].properties.dtype
            )
            for n in names
        }
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            try:
                dcp.load(
                    state, storage_reader=SafeFileSystemReader(self._reader_path), no_dist=True
                )
            except (Exception, dcp.CheckpointException) as exc:
                raise ValueError(f"{self.step_dir}: reading {unit!r} failed ({exc})") from exc
        return {n.removeprefix(self._prefix): t for n, t in state.items()}


_PPO_POLICY = _PREFIX + "policy."
_PPO_CRITIC = _PREFIX + "critic."
PPO_MODELS = ("policy", "critic")
"""The models of a `--stage ppo` checkpoint the converter can write (`--ppo-model`)."""


def _model_prefix(items: dict[str, object]) -> str:
    """`model.`, or `model.policy.` for a `--stage ppo` checkpoint: its model is the policy and
    its critic side by side (training/objectives/ppo.py, PolicyAndCritic), and config.json is
    the policy's, so the policy is what converts (the model a PPO run trains, to serve)."""
    keys = list(items)
    ppo = any(k.startswith(_PPO_POLICY) for k in keys) and any(
        k.startswith(_PPO_CRITIC) for k in keys
    )
    plain = any(
        k.startswith(_PREFIX) and not k.startswith((_PPO_POLICY, _PPO_CRITIC)) for k in keys
    )
    return _PPO_POLICY if ppo and not plain else _PREFIX


class _PullPlanner(DefaultSavePlanner):
    """A save planner whose tensor data comes from `pull(fqn)` at write time."""

    def __init__(self, pull: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._pull = pull

    def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
        """The tensor DCP is about to write, produced on demand."""
        return self._pull(write_item.index.fqn)


class NativeSink:
    """Writes a native checkpoint (step directory + `latest`) into `directory`.

    DCP's writer drives the order (it walks the planned items), so `write_unit` hands units over
    a one-slot queue to a background `dcp.save`, which asks for tensors in planning order: the
    plan lists units in forward order, so the save consumes them as they arrive.
    """

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        dtype: torch.dtype,
        tokenizer: list[Path],
        step: int = 0,
    ) -> None:
        import threading

        self.directory = directory
        self.config = config
        self.tokenizer = tokenizer
        self.step = step
        self.step_dir = directory / f"step-{step:06d}"
        self.step_dir.mkdir(parents=True)
        shapes = expected_shapes(config)
        self._plan = {
            _PREFIX + n: torch.empty(shape, dtype=dtype, device="meta")
            for n, shape in shapes.items()
        }
        self._units: queue.Queue[tuple[Unit, Tensors] | None] = queue.Queue(maxsize=1)
        self._current: dict[str, torch.Tensor] = {}
        self._embedding: torch.Tensor | None = None
        self._handed_out: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._save, daemon=True, name="native-sink")
        self._thread.start()

    def _pull(self, fqn: str) -> torch.Tensor:
        # DCP's file writer keeps every tensor it wrote to a file referenced until the file is
        # closed (torch 2.13, `_write_files_from_queue`), and a native checkpoint is one file.
        # So each tensor is handed over as a private copy whose bytes are released as soon as
        # DCP asks for the next one (by then the previous one is on disk).
        self._release_handed_out()
        tensor = self._next_tensor(fqn.removeprefix(_PREFIX))
        self._handed_out = tensor.clone(memory_format=torch.contiguous_format)
        return self._handed_out

    def _release_handed_out(self) -> None:
        if self._handed_out is not None:
            self._handed_out.untyped_storage().resize_(0)
            self._handed_out = None

    def _next_tensor(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            assert self._embedding is not None
            return self._embedding
        while name not in self._current:
            item = self._units.get()
            if item is None:
                raise RuntimeError(f"conversion stopped before {name} was produced")
            unit, tensors = item
            if self._current:
                raise RuntimeError(
                    f"DCP asked for {name} before {sorted(self._current)[:3]} of the previous unit "
                    "(its write order is not the planned order)"
                )
            self._current = dict(tensors)
            if unit == PRE and self.config.tie_word_embeddings:
                self._embedding = tensors["embed_tokens.weight"]
        return self._current.pop(name)

    def _save(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            try:
                dcp.save(
                    {"model": self._plan_nested()},
                    storage_writer=FileSystemWriter(self.step_dir, thread_count=1),
                    planner=_PullPlanner(self._pull),
                    no_dist=True,
                )
            except BaseException as exc:  # re-raised on the converter's thread in finish()
                self._error = exc

    def _plan_nested(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix(_PREFIX): v for k, v in self._plan.items()}

    def write_unit(self, unit: Unit, tensors: Tensors) -> None:
        """Hands the unit to the background save (blocks while it writes the previous one)."""
        while self._thread.is_alive():
            try:
                self._units.put((unit, tensors), timeout=0.5)
                return
            except queue.Full:
                continue
        raise RuntimeError(f"{self.step_dir}: the DCP writer stopped early ({self._error})")

    def _stop_writer(self) -> None:
        """Tells the DCP thread no more units come, and waits for it to end."""
        while self._thread.is_alive():
            try:
                self._units.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self._thread.join()
        self._release_handed_out()

    def abort(self) -> None:
        """Ends the background save (it fails on the missing units) before the caller cleans up."""
        self._stop_writer()

    def finish(self) -> list[str]:
        """Waits for DCP, then writes train_state.json, config.json, tokenizer/ and `latest`."""
        self._stop_writer()
        if self._error is not None:
            raise RuntimeError(f"{self.step_dir}: writing DCP files failed ({self._error})") from (
                self._error
            )
        state = {
            "format": FORMAT,
            "step": self.step,
            "world_size": 1,
            "extra": {"converted": True},
            "optimizer_param_groups": {},
            "scheduler": None,
            "loss_scaler": None,
        }
        (self.step_dir / "train_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        (self.step_dir / "config.json").write_text(
            json.dumps(self.config.to_dict(), indent=1, sort_keys=True)
        )
        if self.tokenizer:
            (self.step_dir / "tokenizer").mkdir()
            for path in self.tokenizer:
                (self.step_dir / "tokenizer" / path.name).write_bytes(path.read_bytes())
        (self.directory / "latest").write_text(f"{self.step}\n")
        return sorted(
            str(p.relative_to(self.directory)) for p in self.directory.rglob("*") if p.is_file()
        )
