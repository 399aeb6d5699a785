"""Tensor and sequence parallelism: the one applier of a model's TP plan, for training and serving.

Shapes: B batch, S sequence, E hidden, V vocab; S/t is a sequence shard over t TP ranks.

`models.parallel_plan.tp_plan` names a style per submodule; `resolve_tp_plan` is the one place
that reads it for a model and TP size, and `apply_tensor_parallel` applies it in one of two
modes through a style registry:

- "train": DTensor styles (`parallel.tp_registry.training_styles`): embedding rows and the output
  head sharded over the vocabulary, Megatron column/row linears, `SequenceParallel` norms,
  `SlicedColwise` packed projections, the MoE styles of `parallel.expert_parallel`, LoRA-aware
  variants (`parallel.peft_tp`). With sequence parallelism the residual stream between blocks
  is [B, S/t, E] per rank: each attention and MLP block all-gathers its input sequence and its
  row-parallel output is reduce-scattered back (instead of all-reduced), so norms and dropout
  run on 1/t of the tokens.
- "serve": plain local tensors and explicit collectives, no autograd
  (the serving layouts of `parallel.tp_registry.TP_STYLES`); every rank keeps the rows its training style computes
  with, and ends with the whole logits.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import PrepareModuleInput, loss_parallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.config import ModelConfig
from models.parallel_plan import check_tp_size, match_plan, tp_plan
from parallel.peft_tp import parallelize_with_adapters
from parallel.tp_random import install_tp_rng_regions
from parallel.tp_registry import get_style, serving_layouts, training_styles
from parallel.tp_serving import ServingShard

Mode = Literal["train", "serve"]
"""How `apply_tensor_parallel` lays out the plan: DTensor training styles or plain serving ones."""


def resolve_tp_plan(
    model: nn.Module, config: ModelConfig, tp: int, *, sequence_parallel: bool
) -> dict[str, str]:
    """The model's TP plan for `tp` ranks, expanded to `model`'s module names (name -> style).

    KV projections get "kv_replicated" when there are fewer KV heads than ranks (unfused qkv).
    """
    h, k = config.num_attention_heads, config.kv_heads
    # The model reads a packed shard's head counts from its width and the full q:kv ratio; with
    # replicated KV heads (tp > K) that arithmetic only holds for some shapes.
    if config.fused_qkv and k < tp and (h // tp + 2) * h // (h + 2 * k) != h // tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} > num_kv_heads={k} with a fused qkv projection "
            f"and {h} heads cannot be split; use a TP size <= {k} or an unfused qkv model"
        )
    plan = tp_plan(config, sequence_parallel=sequence_parallel)
    if k < tp and not config.fused_qkv:
        for name in ("k_proj", "v_proj"):
            plan["layers.*.self_attn." + name] = "kv_replicated"
    return match_plan(plan, [name for name, _ in model.named_modules()])


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    config: ModelConfig,
    *,
    sequence_parallel: bool = False,
    mode: Mode = "train",
) -> dict[str, str]:
    """Shard `model` (a CausalLM or one pipeline stage of it) over `tp_mesh` in place.

    Returns the resolved plan (module name -> style) for logging. "train": parameters become
    DTensors and logits come out sharded over the vocabulary (compute the loss with
    `tp_cross_entropy_sum`). "serve": parameters stay plain local tensors (no autograd) and
    every rank gets the whole logits; no sequence parallelism.
    """
    if mode not in ("train", "serve"):
        raise ValueError(f"apply_tensor_parallel mode must be 'train' or 'serve', got {mode!r}")
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    if mode == "serve":
        if sequence_parallel:
            raise ValueError("tensor-parallel serving runs without sequence parallelism")
        check_tp_size(config, tp)
    elif config.embedding_layernorm and not sequence_parallel:
        raise ValueError("embedding layernorm models need --sequence-parallel under TP")
    resolved = resolve_tp_plan(model, config, tp, sequence_parallel=sequence_parallel)
    sharded = {}
    for name, style in resolved.items():
        attribute = get_style(style, name).attribute
        if attribute is not None:
            attribute(model.get_submodule(name), config, rank, tp)
        else:
            sharded[name] = style
    if mode == "serve":
        ServingShard(model, config, tp_mesh.get_group(), rank, tp).apply(sharded, serving_layouts())
        return resolved
    module_plan = _training_module_plan(model, config, sharded, resolved, sequence_parallel)
    # LoRA layers take adapter-aware styles; PEFT-frozen parameters stay frozen.
    parallelize_with_adapters(
        model, tp_mesh, module_plan, resolved, sequence_parallel=sequence_parallel
    )
    tie_weights = getattr(model, "tie_weights", None)
    if config.tie_word_embeddings and callable(tie_weights):
        # Each style swapped in its own parameter, untying the head; both are vocabulary-row
        # shards (Shard(0)) on the same mesh, so the head can share the embedding's DTensor.
        tie_weights()
    _replicate_the_rest(model, tp_mesh, config, resolved, sequence_parallel)
    for name in install_tp_rng_regions(
        model, config, tp_mesh.get_local_rank(), sequence_parallel=sequence_parallel
    ):
        resolved[name] = f"{resolved[name]} + tp_rng" if name in resolved else "tp_rng"
    return resolved


def _training_module_plan(
    model: nn.Module,
    config: ModelConfig,
    sharded: dict[str, str],
    resolved: dict[str, str],
    sequence_parallel: bool,
) -> dict[str, ParallelStyle]:
    """The training styles of the sharded modules, plus (under SP) the gathers before each
    attention and MLP block without a style of its own (recorded in `resolved`)."""
    styles = training_styles(config, sequence_parallel=sequence_parallel)
    names = [name for name, _ in model.named_modules()]
    module_plan: dict[str, ParallelStyle] = {n: styles[s] for n, s in sharded.items()}
    if sequence_parallel:
        # Attention takes (x, rope, padding mask, segment ids, cache); the MLP takes x. A
        # block with its own style (an MoE layer) gathers its input itself.
        for suffix, extra in ((".self_attn", 4), (".mlp", 0)):
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * extra,
                desired_input_layouts=(Replicate(),) + (None,) * extra,
                use_local_output=True,
            )
            for name in names:
                if name.endswith(suffix) and name not in module_plan:
                    module_plan[name] = gather
                    resolved[name] = "gather_sequence"
    return module_plan


def _replicate_the_rest(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    config: ModelConfig,
    resolved: dict[str, str],
    sequence_parallel: bool,
) -> None:
    """Every module with a parameter no style sharded holds it replicated, its gradient summed
    over the ranks where its input is a shard (recorded in `resolved`)."""
    tp = tp_mesh.size()
    for name, module in model.named_modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            # Qwen3's per-head q/k norms see only this rank's heads: their input is a head shard
            # (dim 2 of [B, S, heads, D]), so the scale's gradient is summed over the ranks.
            # Replicated kv heads (tp > K) are whole on every rank instead.
            head_shard = name.endswith(".self_attn.q_norm") or (
                name.endswith(".self_attn.k_norm") and config.kv_heads >= tp
            )
            # Under SP an MoE layer's shared experts (and their gate) run on this rank's
            # sequence slice (`MoESequenceParallel`): their gradients are summed likewise.
            sequence_shard = sequence_parallel and (
                ".mlp.shared_experts." in name or name.endswith(".mlp.shared_expert_gate")
            )
            if head_shard:
                _replicate_module(module, tp_mesh, Shard(2))
                resolved[name] = "replicate (head-sharded input)"
            elif sequence_shard:
                _replicate_module(module, tp_mesh, Shard(1))
                resolved[name] = "replicate (sequence-sharded input)"
            else:
                _replicate_module(module, tp_mesh, Replicate())
                resolved[name] = "replicate"


def _replicate_module(
    module: nn.Module, mesh: DeviceMesh, input_placement: Shard | Replicate | None = None
) -> None:
    """Hold `module`'s own parameters as Replicate DTensors and run it on DTensor inputs placed
    as `input_placement` (default Replicate; a Shard makes the parameters' gradients sums over
    the ranks).

    Optimizers and gradient clipping need every parameter of a TP model to be a DTensor (their
    foreach kernels refuse a mix); plain tensors in and out keep the module's neighbours as is.
    """

    def replicate_params(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for leaf, param in list(mod.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            mod.register_parameter(leaf, nn.Parameter(replicated, param.requires_grad))

    placement = input_placement or Replicate()

    def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [placement], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, replicate_params, inputs, outputs)  # type: ignore[arg-type]


def tp_cross_entropy_sum(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, loss_mask_BS: torch.Tensor
) -> torch.Tensor:
    """Summed masked token loss of vocabulary-sharded logits (loss parallel: no full logits).

    Call (and backpropagate) inside `loss_parallel()`; plain logits fall back to F.cross_entropy.
    """
    per_token = tp_token_cross_entropy(logits_BSV, labels_BS).flatten()
    return (per_token * loss_mask_BS.flatten().to(per_token.dtype)).sum()


def tp_token_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [B,S] in fp32 (0 where the label is -100) of vocabulary-sharded
    logits, a plain tensor (the preference objectives' log-probabilities are its negation).

    Call (and backpropagate) inside `loss_parallel()`; plain logits fall back to F.cross_entropy.
    """
    flat = logits_BSV.flatten(0, 1).float()
    labels = labels_BS.flatten()
    if isinstance(flat, DTensor):
        labels = DTensor.from_local(labels, flat.device_mesh, [Replicate()], run_check=False)
    per_token = F.cross_entropy(flat, labels, ignore_index=-100, reduction="none")
    if isinstance(per_token, DTensor):
        per_token = per_token.to_local()
    return per_token.view(labels_BS.shape)


__all__ = [
    "Mode",
    "apply_tensor_parallel",
    "loss_parallel",
    "resolve_tp_plan",
    "tp_cross_entropy_sum",
    "tp_token_cross_entropy",
]
