"""Pipeline stages as data: which global layers each (rank, virtual chunk) holds.

With P pipeline ranks and V virtual chunks per rank there are P·V stages. Stage index
`c·P + r` is chunk c of rank r (Megatron's interleaved layout), and stages hold consecutive
layers in stage-index order, so layer data flows rank 0 → P-1 for chunk 0, then back to rank 0
for chunk 1. The embedding sits on stage 0, the final norm and output head on stage P·V-1.
`build_stage` cuts a model down to one stage while keeping the global names ("layers.17...").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.config import ModelConfig

if TYPE_CHECKING:
    from models.transformer import CausalLM


@dataclass(frozen=True)
class StageRange:
    """The layers [layer_start, layer_end) of one pipeline stage, and what else it holds."""

    stage_index: int
    """Position in the pipeline order (chunk * pp_size + pp_rank)."""
    pp_rank: int
    """Pipeline rank that runs this stage."""
    chunk: int
    """Virtual chunk of that rank (0 without virtual pipelining)."""
    layer_start: int
    """First global layer index held."""
    layer_end: int
    """One past the last global layer index held."""
    has_embedding: bool
    """Holds embed_tokens (and the position table and embedding layernorm): the first stage."""
    has_head: bool
    """Holds the final norm and lm_head: the last stage."""

    @property
    def num_layers(self) -> int:
        """Layers held."""
        return self.layer_end - self.layer_start

    @property
    def layer_ids(self) -> range:
        """Global indices of the layers held."""
        return range(self.layer_start, self.layer_end)


def split_stages(
    num_layers: int,
    pp_size: int,
    virtual_size: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[StageRange]:
    """Split `num_layers` into pp_size·virtual_size stages, returned in stage-index order.

    Even by default; uneven through `layers_per_stage` (one count per stage index, like
    ModelLink's `--num-layer-list`) or through `first_stage_layers` / `last_stage_layers`
    (Megatron's `--num-layers-in-first/last-pipeline-stage`) with the rest spread evenly.
    """
    if pp_size < 1 or virtual_size < 1:
        raise ValueError(
            f"split_stages: pipeline size {pp_size} and virtual size {virtual_size} must be >= 1"
        )
    stages = pp_size * virtual_size
    if layers_per_stage is not None:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(
                "split_stages: give layers_per_stage or first/last_stage_layers, not both"
            )
        counts = list(layers_per_stage)
        if len(counts) != stages:
            raise ValueError(
                f"split_stages: layers_per_stage has {len(counts)} entries but there are {stages} "
                f"stages (pipeline {pp_size} × virtual {virtual_size}); give one count per stage"
            )
    else:
        counts = _even_counts(num_layers, stages, first_stage_layers, last_stage_layers)
    if sum(counts) != num_layers or min(counts) < 0:
        raise ValueError(
            f"split_stages: per-stage layer counts {counts} must be >= 0 and sum to "
            f"num_layers={num_layers}"
        )
    result, start = [], 0
    for index, count in enumerate(counts):
        result.append(
            StageRange(
                stage_index=index,
                pp_rank=index % pp_size,
                chunk=index // pp_size,
                layer_start=start,
                layer_end=start + count,
                has_embedding=index == 0,
                has_head=index == stages - 1,
            )
        )
        start += count
    return result


def _even_counts(num_layers: int, stages: int, first: int | None, last: int | None) -> list[int]:
    """Even split of the layers not pinned to the first/last stage; fails if it cannot be even."""
    pinned = [c for c in (first, last) if c is not None]
    middle_stages = stages - len(pinned)
    middle_layers = num_layers - sum(pinned)
    if stages == 1 and pinned:
        raise ValueError("split_stages: first/last_stage_layers need at least two stages")
    if middle_stages == 0:
        return pinned
    if middle_layers < 0 or middle_layers % middle_stages:
        raise ValueError(
            f"split_stages: {middle_layers} layer(s) cannot be split evenly over {middle_stages} "
            f"stage(s) (num_layers={num_layers}, first={first}, last={last}); pass "
            "layers_per_stage for an uneven split"
        )
    counts = [middle_layers // middle_stages] * middle_stages
    if first is not None:
        counts.insert(0, first)
    if last is not None:
        counts.append(last)
    return counts


def stages_of_rank(stages: Sequence[StageRange], pp_rank: int) -> list[StageRange]:
    """The stages (virtual chunks) that `pp_rank` runs, in chunk order."""
    return [stage for stage in stages if stage.pp_rank == pp_rank]


def build_stage(model_or_config: CausalLM | ModelConfig, stage: StageRange) -> CausalLM:
    """A CausalLM holding only `stage`'s parts, with global names kept.

    Given a config, the stage is built on the meta device (then `to_empty` + `init_weights`);
    given a model, that model is pruned in place and returned. With tied embeddings a last stage
    that lacks the embedding gets its own head weight (a copy); the trainer keeps the two in
    sync, as Megatron does.
    """
    if isinstance(model_or_config, ModelConfig):
        from models.transformer import build_model  # the kernels only when a model is built

        model = build_model(model_or_config, device="meta")
    else:
        model = model_or_config
    config = model.config
    if stage.layer_end > config.num_layers:
        raise ValueError(
            f"build_stage: stage holds layers up to {stage.layer_end - 1} but the model has "
            f"{config.num_layers}"
        )
    for key in list(model.layers.keys()):
        if int(key) not in stage.layer_ids:
            del model.layers[key]
    if not stage.has_head:
        model.norm = None
        model.lm_head = None
    elif config.tie_word_embeddings and not stage.has_embedding and model.lm_head is not None:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    if not stage.has_embedding:
        model.embed_tokens = None
        model.embed_positions = None
        model.embed_layernorm = None
    return model


def stage_parameter_names(config: ModelConfig, stage: StageRange) -> list[str]:
    """State-dict names one stage holds (handy for checkpoint planning)."""
    with torch.device("meta"):
        return list(build_stage(config, stage).state_dict().keys())
