"""Megatron legacy checkpoints: `iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`.

Each file holds `{"args": Namespace, "checkpoint_version": 3.0, "iteration": N, "model": {...}}`
(`model0`, `model1`, ... for virtual pipeline chunks) with the tensors of one TP rank of one
pipeline stage (see megatron_layout for names and splits). `latest_checkpointed_iteration.txt`
names the iteration, or `release` for converted checkpoints (Megatron refuses iteration 0).

Files are read with `torch_files.load_weights_only` (a static check of every global, then
`torch.load(weights_only=True, mmap=True)`) and an allow-list of the few
non-tensor types Megatron stores (`argparse.Namespace`), never a plain unpickle; each unit reopens
the files it needs, so only that unit's bytes are paged in. The writer is megatron_writer.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
import types
from pathlib import Path
from typing import Any

import torch

from checkpoints.bounds import check_declared_size
from checkpoints.megatron_layout import (
    Shards,
    StageLayout,
    edge_from_megatron,
    layer_from_megatron,
)
from checkpoints.torch_files import load_weights_only
from checkpoints.units import POST, PRE, Tensors, Unit, reconcile, unit_label
from models.config import ModelConfig

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
MAX_PARALLEL_SIZE = 4096
"""Largest TP or PP size a checkpoint's args may declare."""
_MEGATRON_ENUMS = (
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"),
)


@functools.cache
def safe_globals() -> list[Any]:
    """The only non-tensor, non-builtin types a Megatron file may hold: the args Namespace and
    the enums newer Megatron versions store in it (plain Enums: rebuilt by value, no code runs).
    The enums are allowed only when megatron-core is installed (they cannot be resolved
    otherwise); numpy RNG states and torch dtypes are allowed by torch itself."""
    allowed: list[Any] = [argparse.Namespace, types.SimpleNamespace]
    for module, name in _MEGATRON_ENUMS:
        try:
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return allowed


_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_RENAMES = (
    (re.compile(r"^language_model\."), ""),
    (re.compile(r"^transformer\."), "encoder."),
    (re.compile(r"\.input_layernorm\."), ".input_norm."),
    (re.compile(r"\.post_attention_layernorm\."), ".post_attention_norm."),
    (re.compile(r"\.final_layernorm\."), ".final_norm."),
)
_ARG_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size",
}
_NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
_POSITIONS = {"rope": "rope", "alibi": "alibi", "learned_absolute": "learned"}


def math_mismatches(args: Any, config: ModelConfig) -> list[str]:
    """The checkpoint args (Megatron's flags as saved) that say the model computes otherwise
    than `config`: normalization, position embedding, SwiGLU and the GeLU form."""
    out = []
    norm = getattr(args, "normalization", None)
    if norm in _NORMS and _NORMS[norm] != config.norm_type:
        out.append(f"normalization={norm} but norm_type={config.norm_type!r}")
    position = getattr(args, "position_embedding_type", None)
    if position in _POSITIONS and _POSITIONS[position] != config.position_embedding:
        out.append(
            f"position_embedding_type={position} but position_embedding="
            f"{config.position_embedding!r}"
        )
    swiglu = getattr(args, "swiglu", None)
    if swiglu is not None and bool(swiglu) != (config.activation == "swiglu"):
        out.append(f"swiglu={swiglu} but activation={config.activation!r}")
    openai_gelu = getattr(args, "openai_gelu", None)
    gelu = "gelu" if openai_gelu else "gelu_exact"
    plain_gelu = config.activation in ("gelu", "gelu_exact")
    if openai_gelu is not None and not swiglu and plain_gelu and config.activation != gelu:
        out.append(f"openai_gelu={openai_gelu} but activation={config.activation!r}")
    return out


def load_file(path: Path) -> dict[str, Any]:
    """One `model_optim_rng.pt`, memory-mapped, through the allow-list (clear errors otherwise)."""
    state = load_weights_only(
        path,
        safe_globals(),
        "a trusted file with other types must be re-saved without them, e.g. with --no-save-optim",
    )
    if not isinstance(state, dict) or not any(k.startswith("model") for k in state):
        raise ValueError(f"{path} holds no `model` state: not a Megatron checkpoint file")
    return state


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
            flat[name] = value
    return flat


def _parallel_size(args: Any, kind: str, path: Path) -> int:
    """`args.<kind>_model_parallel_size` (1 when absent), checked to be a sane integer."""
    name = f"{kind}_model_parallel_size"
    value = getattr(args, name, None)
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= MAX_PARALLEL_SIZE:
        raise ValueError(
            f"{path}: args.{name}={value!r} is not an integer in [1, {MAX_PARALLEL_SIZE}]; the "
            "file is corrupted or not trusted"
        )
    return value


def _resolve_iteration(directory: Path, iteration: int | None) -> Path:
    if iteration is not None:
        path = directory / f"iter_{iteration:07d}"
        if not path.is_dir():
            raise FileNotFoundError(f"{path} does not exist (--load-iteration {iteration})")
        return path
    tracker = directory / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(
            f"{tracker} is missing: {directory} is not a Megatron checkpoint directory"
        )
    text = tracker.read_text().strip()
    if text == "release":
        path = directory / "release"
    elif text.isdigit():
        path = directory / f"iter_{int(text):07d}"
    else:
        raise ValueError(f"{tracker} should hold an iteration number or 'release', not {text!r}")
    if not path.is_dir():
        raise FileNotFoundError(f"{tracker} names {path.name}, which does not exist")
    return path


class MegatronSource:
    """A Megatron legacy checkpoint opened for per-unit reads (any TP/PP/virtual layout)."""

    def __init__(
        self,
        directory: Path,
        config: ModelConfig | None,
        iteration: int | None = None,
        full_weights: bool = True,
    ) -> None:
        """`full_weights=False` opens an adapter-only checkpoint (Megatron LoRA), whose files
        hold no full weights: its size is then not checked against `config` (which the source
        being converted has already checked)."""
        self.iter_dir = _resolve_iteration(directory, iteration)
        ranks: dict[tuple[int, int], Path] = {}
        for path in self.iter_dir.iterdir():
            match = _RANK_DIR.match(path.name)
            if match:
                ranks[(int(match.group(1)), int(match.group(2) or 0))] = path / FILE
        if not ranks:
            raise FileNotFoundError(f"{self.iter_dir} holds no mp_rank_* directories")
        present = [path for _, path in sorted(ranks.items()) if path.is_file()]
        if not present:
            raise FileNotFoundError(f"{self.iter_dir}: no mp_rank directory holds {FILE}")
        first = load_file(present[0])
        args = first.get("args")
        # The saved sizes, when present, catch a whole missing rank directory at the edge.
        self.tp = max(1 + max(t for t, _ in ranks), _parallel_size(args, "tensor", present[0]))
        self.pp = max(1 + max(p for _, p in ranks), _parallel_size(args, "pipeline", present[0]))
        for t in range(self.tp):
            for p in range(self.pp):
                if (t, p) not in ranks or not ranks[(t, p)].is_file():
                    raise FileNotFoundError(
                        f"{self.iter_dir}: {FILE} of TP rank {t}, PP rank {p} is missing "
                        f"(expected a full {self.tp}x{self.pp} grid of mp_rank directories)"
                    )
        self._files = ranks
        self.args = args
        """The `args` Namespace of the first file (None when the checkpoint has none)."""
        iteration = first.get("iteration", 0) or 0
        if type(iteration) is not int or iteration < 0:
            raise ValueError(f"{present[0]}: iteration {iteration!r} is not a step number")
        self.iteration = iteration
        self.config = self._config(config, args)
        if full_weights:
            check_declared_size(self.config, present, str(self.iter_dir))
        chunks = sorted(k for k in first if re.fullmatch(r"model\d+", k))
        self._chunk_keys = chunks or ["model"]
        self.layout = StageLayout(self.config.num_layers, self.pp, len(self._chunk_keys))
        tokenizer = directory / "tokenizer"
        self.tokenizer_files = sorted(tokenizer.iterdir()) if tokenizer.is_dir() else []

    def _config(self, config: ModelConfig | None, args: Any) -> ModelConfig:
        saved = getattr(args, "meshline_model_config", None)
        if saved is not None:
            try:
                own = ModelConfig.from_dict(json.loads(saved))
            except (TypeError, AttributeError, ValueError) as exc:
                raise ValueError(
                    f"{self.iter_dir}: args.meshline_model_config is not a valid model config "
                    f"({exc})"
                ) from exc
            config = reconcile(own, config, f"{self.iter_dir} (args.meshline_model_config)")
        elif config is None:
            raise ValueError(
                f"{self.iter_dir}: the checkpoint does not record a Meshline model config; "
                "pass --model NAME (e.g. llama2-7B) naming its architecture"
            )
        if args is not None:
            for arg, field in _ARG_FIELDS.items():
                theirs, ours = getattr(args, arg, None), getattr(config, field)
                if theirs is not None and theirs != ours:
                    raise ValueError(
                        f"{self.iter_dir}: checkpoint args say {arg}={theirs} but the model config "
                        f"has {field}={ours}; pass the matching --model"
                    )
            wrong = math_mismatches(args, config)
            if wrong:
                raise ValueError(
                    f"{self.iter_dir}: checkpoint args say {'; '.join(wrong)}; pass the --model "
                    "whose architecture the checkpoint was trained with"
                )
            groups = getattr(args, "num_query_groups", None)
            if getattr(args, "group_query_attention", False) and groups != config.kv_heads:
                raise ValueError(
                    f"{self.iter_dir}: checkpoint has {groups} query groups but the model config "
                    f"has {config.kv_heads} kv heads; pass the matching --model"
                )
        return config

    def _read(self, stage: int, chunk: int, prefixes: tuple[str, ...]) -> Shards:
        """Tensors under `prefixes` of one chunk on one stage, one per TP rank, copied out of the
        memory map so the file can be released."""
        shards: Shards = {}
        for tp_rank in range(self.tp):
            path = self._files[(tp_rank, stage)]
            state = load_file(path)
            key = self._chunk_keys[chunk]
            if key not in state:
                raise ValueError(f"{path} lacks {key!r} (other ranks have virtual chunks)")
            for name, tensor in _flatten(state[key]).items():
                if name.startswith(prefixes):
                    shards.setdefault(name, []).append(tensor.clone())
            del state
        return shards

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors with TP shards merged and vocabulary padding dropped."""
        try:
            if unit == PRE:
                return edge_from_megatron(unit, self._read(0, 0, ("embedding.",)), self.config)
            if unit == POST:
                prefixes = ("encoder.final_norm.", "output_layer.", "rm_head.")
                shards = self._read(self.pp - 1, self.layout.chunks - 1, prefixes)
                return edge_from_megatron(unit, shards, self.config)
            return layer_from_megatron(int(unit), self.read_layer_shards(int(unit)), self.config)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(
                f"{self.iter_dir}: {unit_label(unit)} has missing or mis-shaped tensors ({exc}); "
                "the checkpoint is corrupted or does not match --model"
            ) from exc

    def read_shards(self, stage: int, chunk: int) -> Shards:
        """Every tensor of one virtual chunk of one pipeline stage, one per TP rank, under the
        Megatron names read_unit starts from (`encoder.layers.<local>....`)."""
        return self._read(stage, chunk, ("",))

    def read_layer_shards(self, layer: int) -> Shards:
        """Every tensor of global `layer` as saved, one per TP rank, under layer-relative Megatron
        names (`self_attention.query_key_value.weight`, ...)."""
        stage, chunk, local = self.layout.locate(layer)
        prefix = f"encoder.layers.{local}."
        shards = self._read(stage, chunk, (prefix,))
        return {name.removeprefix(prefix): t for name, t in shards.items()}
