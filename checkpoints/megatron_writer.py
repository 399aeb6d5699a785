"""Writes Megatron legacy checkpoints (layout in megatron_format and megatron_layout).

One `torch.save`-format file per (TP rank, pipeline stage), written as the units arrive
(torch_stream): each TP shard goes to its file the moment its unit is split, and a file's pickled
structure is written once its stage has received all its layers (and, on the edges, the embedding /
final norm). Memory holds one unit and its shards, whatever the TP, PP or virtual-chunk layout;
every stage's files stay open until the stage completes (TP × PP open files at most).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from checkpoints.megatron_format import CHECKPOINT_VERSION, FILE, TRACKER
from checkpoints.megatron_layout import (
    StageLayout,
    edge_to_megatron,
    layer_to_megatron,
    padded_vocab_size,
)
from checkpoints.torch_stream import StreamingTorchFile, TensorRef
from checkpoints.units import POST, PRE, Tensors, Unit
from models.config import ModelConfig

_POSITION_TYPES = {"rope": "rope", "alibi": "alibi", "learned": "learned_absolute"}
"""ModelConfig.position_embedding → Megatron's --position-embedding-type."""


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes (torch.save writes a view's whole storage)."""
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor.contiguous()
    return tensor.clone(memory_format=torch.contiguous_format)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Megatron's nesting: language_model.{embedding.word_embeddings, encoder, output_layer}."""
    language_model: dict[str, Any] = {}
    for name, tensor in flat.items():
        head, _, rest = name.partition(".")
        if head == "embedding":
            sub, _, leaf = rest.partition(".")
            language_model.setdefault("embedding", {}).setdefault(sub, {})[leaf] = tensor
        else:
            language_model.setdefault(head, {})[rest] = tensor
    return {"language_model": language_model}


class MegatronSink:
    """Writes a Megatron legacy checkpoint for a target TP × PP (× virtual chunks) layout."""

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        dtype: torch.dtype,
        tokenizer: list[Path],
        tp: int = 1,
        pp: int = 1,
        layers_per_virtual_stage: int | None = None,
        iteration: int = 0,
        make_vocab_size_divisible_by: int = 128,
    ) -> None:
        chunks = 1
        if layers_per_virtual_stage is not None:
            per_stage, rest = divmod(config.num_layers, pp)
            if rest or per_stage % layers_per_virtual_stage:
                raise ValueError(
                    f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} must "
                    f"divide the {per_stage if not rest else config.num_layers / pp} layers per "
                    f"pipeline stage ({config.num_layers} layers over PP {pp})"
                )
            chunks = per_stage // layers_per_virtual_stage
        self.layout = StageLayout(config.num_layers, pp, chunks)
        self.directory, self.config, self.dtype, self.tp = directory, config, dtype, tp
        self.tokenizer = tokenizer
        self.iteration = iteration
        self.divisible_by = make_vocab_size_divisible_by
        self.padded_vocab = padded_vocab_size(config.vocab_size, make_vocab_size_divisible_by, tp)
        self.layers_per_virtual_stage = layers_per_virtual_stage
        self.iter_name = f"iter_{iteration:07d}" if iteration > 0 else "release"
        # stage -> chunk -> Megatron name (relative to language_model) -> per-rank written refs
        self._pending: dict[int, dict[int, dict[str, list[TensorRef]]]] = {}
        self._open: dict[tuple[int, int], StreamingTorchFile] = {}
        self._files: list[str] = []

    def _path(self, tp_rank: int, stage: int) -> Path:
        name = f"mp_rank_{tp_rank:02d}" + (f"_{stage:03d}" if self.layout.pp > 1 else "")
        return self.directory / self.iter_name / name / FILE

    def _file(self, tp_rank: int, stage: int) -> StreamingTorchFile:
        if (tp_rank, stage) not in self._open:
            path = self._path(tp_rank, stage)
            path.parent.mkdir(parents=True)
            self._open[(tp_rank, stage)] = StreamingTorchFile(path)
        return self._open[(tp_rank, stage)]

    def _stage_done(self, stage: int) -> bool:
        held = self._pending.get(stage, {})
        need = sum(len(self.layout.layers(stage, c)) for c in range(self.layout.chunks))
        got = sum(
            len({n.split(".")[2] for n in held.get(c, {}) if n.startswith("encoder.layers.")})
            for c in range(self.layout.chunks)
        )
        edges = (stage != 0 or "embedding.word_embeddings.weight" in held.get(0, {})) and (
            stage != self.layout.pp - 1
            or "encoder.final_norm.weight" in held.get(self.layout.chunks - 1, {})
        )
        return got == need and edges

    def write_unit(self, unit: Unit, tensors: Tensors) -> None:
        """Splits the unit over TP and files it under its stage; writes stages once complete."""
        if unit in (PRE, POST):
            stage, chunk = (0, 0) if unit == PRE else (self.layout.pp - 1, self.layout.chunks - 1)
            shards = edge_to_megatron(
                unit, tensors, self.tp, self.padded_vocab, self.config.value_head
            )
            if unit == PRE and self.config.tie_word_embeddings and self.layout.pp > 1:
                # The last stage's copy of the embedding, for its tied output layer: written into
                # that stage's files now rather than held until the head arrives.
                last, last_chunk = self.layout.pp - 1, self.layout.chunks - 1
                head = self._write(last, shards["embedding.word_embeddings.weight"])
                self._pending.setdefault(last, {}).setdefault(last_chunk, {})[
                    "word_embeddings_for_head.weight"
                ] = head
        else:
            stage, chunk, local = self.layout.locate(int(unit))
            layer = layer_to_megatron(int(unit), tensors, self.config, self.tp)
            shards = {f"encoder.layers.{local}.{n}": t for n, t in layer.items()}
        held = self._pending.setdefault(stage, {}).setdefault(chunk, {})
        for name, per_rank in shards.items():
            held[name] = self._write(stage, per_rank)
        if self._stage_done(stage):
            self._save_stage(stage, self._pending.pop(stage))

    def _write(self, stage: int, per_rank: list[torch.Tensor]) -> list[TensorRef]:
        """Each rank's shard into its file of `stage`, now; the refs stand for them."""
        return [self._file(r, stage).add(_compact(t)) for r, t in enumerate(per_rank)]

    def _args(self) -> argparse.Namespace:
        c = self.config
        return argparse.Namespace(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.ffn_hidden_size,
            num_attention_heads=c.num_attention_heads,
            group_query_attention=c.kv_heads != c.num_attention_heads,
            num_query_groups=c.kv_heads,
            kv_channels=c.head_dim,
            max_position_embeddings=c.max_position_embeddings,
            padded_vocab_size=self.padded_vocab,
            make_vocab_size_divisible_by=self.divisible_by,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.layout.pp,
            num_layers_per_virtual_pipeline_stage=self.layers_per_virtual_stage,
            virtual_pipeline_model_parallel_size=(
                self.layout.chunks if self.layers_per_virtual_stage else None
            ),
            normalization="RMSNorm" if c.norm_type == "rmsnorm" else "LayerNorm",
            norm_epsilon=c.norm_eps,
            position_embedding_type=_POSITION_TYPES[c.position_embedding],
            add_position_embedding=c.position_embedding == "learned",
            rotary_base=c.rope_theta,
            swiglu=c.activation == "swiglu",
            openai_gelu=c.activation == "gelu",
            add_bias_linear=c.mlp_bias,
            add_qkv_bias=c.attention_bias or c.qkv_bias,
            qk_layernorm=c.qk_norm,
            sliding_window=c.sliding_window,
            num_experts=c.moe.num_experts if c.moe is not None else None,
            moe_router_topk=c.moe.top_k if c.moe is not None else None,
            untie_embeddings_and_output_weights=not c.tie_word_embeddings,
            embed_layernorm=c.embedding_layernorm,
            params_dtype=self.dtype,
            iteration=self.iteration,
            consumed_train_samples=0,
            consumed_valid_samples=0,
            meshline_model_config=json.dumps(c.to_dict(), sort_keys=True),
        )

    def _save_stage(self, stage: int, chunks: dict[int, dict[str, list[TensorRef]]]) -> None:
        """Writes the structure of the stage's files (their tensors are already on disk)."""
        args = self._args()
        for tp_rank in range(self.tp):
            state: dict[str, Any] = {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": self.iteration,
            }
            for chunk in range(self.layout.chunks):
                flat = {n: refs[tp_rank] for n, refs in chunks.get(chunk, {}).items()}
                head = flat.pop("word_embeddings_for_head.weight", None)
                model = _nest(flat)
                if head is not None:
                    model["word_embeddings_for_head"] = {"weight": head}
                state["model" if self.layout.chunks == 1 else f"model{chunk}"] = model
            self._file(tp_rank, stage).close(state)
            del self._open[(tp_rank, stage)]
            path = self._path(tp_rank, stage)
            self._files.append(str(path.relative_to(self.directory)))

    def abort(self) -> None:
        """Ends the files still open (incomplete; the caller removes the directory)."""
        for handle in self._open.values():
            handle.abandon()
        self._open.clear()
        self._pending.clear()

    def finish(self) -> list[str]:
        """Checks every stage was written, then writes the tracker file and tokenizer."""
        if self._pending:
            raise RuntimeError(f"stages {sorted(self._pending)} never received all their layers")
        tracker = "release" if self.iter_name == "release" else str(self.iteration)
        (self.directory / TRACKER).write_text(tracker + "\n")
        files = [*self._files, TRACKER]
        if self.tokenizer:
            (self.directory / "tokenizer").mkdir()
            for path in self.tokenizer:
                shutil.copy2(path, self.directory / "tokenizer" / path.name)
                files.append(f"tokenizer/{path.name}")
        return sorted(files)
