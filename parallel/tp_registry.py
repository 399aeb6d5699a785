"""The one registry of tensor-parallel styles: plan style name -> how training and serving lay it
out.

`models.parallel_plan.tp_plan` names a style per submodule (plain strings: models know nothing of
parallelism); `parallel.tensor_parallel.apply_tensor_parallel` looks each name up here. A style
has up to three parts:
- `train`: the DTensor `ParallelStyle` for training, built per run from a `StyleContext`
  (classes in `parallel/tp_styles.py`, `parallel/expert_parallel.py`);
- `serve`: the plain-tensor layout for serving (`parallel/tp_serving.py`); None means serving
  refuses a plan that uses the style, naming it;
- `attribute`: a setting applied in both modes instead of a layout (ALiBi's head offset).

Adding a style: its implementation beside its feature, one entry here, and its name in the plan
(`models/parallel_plan.py`); `tests/parallel/test_tp_registry.py` checks that every plan's
style is registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from models.config import ModelConfig
from parallel.expert_parallel import ExpertsTensorParallel, MoESequenceParallel
from parallel.tp_serving import (
    ServingLayout,
    colwise_layout,
    embedding_layout,
    lm_head_layout,
    rowwise_layout,
    sliced_layout,
    whole_layout,
)
from parallel.tp_styles import RowsOfRank, SlicedColwise, row_selectors


@dataclass(frozen=True)
class StyleContext:
    """What a training style is built from: the model and the run's sequence parallelism."""

    config: ModelConfig
    sequence_parallel: bool

    @property
    def seq(self) -> Placement:
        """The activations' layout between blocks: sharded on the sequence under SP."""
        return Shard(1) if self.sequence_parallel else Replicate()

    @functools.cached_property
    def rows(self) -> dict[str, RowsOfRank]:
        """Rows each rank computes with, per packed style (`row_selectors`)."""
        return row_selectors(self.config)


def set_alibi_head_offset(module: nn.Module, config: ModelConfig, rank: int, tp: int) -> None:
    """Column-parallel q keeps heads [r·H/t, (r+1)·H/t) on rank r: ALiBi uses their slopes."""
    module.head_offset = rank * (config.num_attention_heads // tp)  # type: ignore[assignment]


@dataclass(frozen=True)
class TPStyle:
    """One plan style: its training style, serving layout and/or attribute setting."""

    train: Callable[[StyleContext], ParallelStyle] | None = None
    serve: ServingLayout | None = None
    attribute: Callable[[nn.Module, ModelConfig, int, int], None] | None = None


TP_STYLES: dict[str, TPStyle] = {
    "vocab_parallel_embedding": TPStyle(
        lambda c: RowwiseParallel(input_layouts=Replicate(), output_layouts=c.seq),
        embedding_layout,
    ),
    "colwise": TPStyle(lambda c: ColwiseParallel(), colwise_layout),
    "rowwise": TPStyle(lambda c: RowwiseParallel(output_layouts=c.seq), rowwise_layout),
    "colwise_packed_qkv": TPStyle(
        lambda c: SlicedColwise(c.rows["colwise_packed_qkv"]), sliced_layout("colwise_packed_qkv")
    ),
    "colwise_packed_gate_up": TPStyle(
        lambda c: SlicedColwise(c.rows["colwise_packed_gate_up"]),
        sliced_layout("colwise_packed_gate_up"),
    ),
    # Plain local outputs: a norm output may become the residual stream (embed_layernorm).
    # Serving runs without sequence parallelism, so SP styles have no serving layout.
    "sequence_parallel": TPStyle(lambda c: SequenceParallel(use_local_output=True)),
    "colwise_loss_parallel": TPStyle(
        lambda c: ColwiseParallel(
            input_layouts=c.seq, output_layouts=Shard(-1), use_local_output=False
        ),
        lm_head_layout,
    ),
    # A reward model's scalar head (one output: nothing to shard) is replicated; under SP its
    # input, the final norm's sequence shard, is gathered so every rank scores every position.
    "value_head": TPStyle(
        lambda c: PrepareModuleInput(
            input_layouts=(c.seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        whole_layout,
    ),
    "kv_replicated": TPStyle(lambda c: SlicedColwise(c.rows["kv_replicated"])),
    "moe_experts": TPStyle(
        lambda c: ExpertsTensorParallel(
            c.config.ffn_hidden_size, sequence_parallel=c.sequence_parallel
        ),
        whole_layout,
    ),
    "moe_sequence_parallel": TPStyle(lambda c: MoESequenceParallel()),
    "alibi_heads": TPStyle(attribute=set_alibi_head_offset),
}
"""Plan style name -> its layouts (the keys are the names `models.parallel_plan` uses)."""


def get_style(name: str, module_name: str) -> TPStyle:
    """The registered style `name` (ValueError naming the module and the registry)."""
    style = TP_STYLES.get(name)
    if style is None:
        raise ValueError(
            f"tensor-parallel plan style {name!r} (module {module_name}) is not registered; "
            f"known: {', '.join(TP_STYLES)} (parallel/tp_registry.py)"
        )
    return style


def training_styles(config: ModelConfig, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Style name -> DTensor ParallelStyle for this model and run (styles with a training part)."""
    context = StyleContext(config, sequence_parallel)
    return {name: s.train(context) for name, s in TP_STYLES.items() if s.train is not None}


def serving_layouts() -> dict[str, ServingLayout | None]:
    """Style name -> serving layout (None: the style cannot be served)."""
    return {name: s.serve for name, s in TP_STYLES.items() if s.attribute is None}
