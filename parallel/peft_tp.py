"""Parameter-efficient fine-tuning under tensor parallelism (issue #10).

Shapes: N tokens (any leading dims; [B, S] for the sequence-parallel cases), I in features,
O out features, R LoRA rank, P prefix length, K kv heads, D head dim; /t is a TP shard.

LoRA adapters are sharded consistently with the layer they adapt (Megatron / ModelLink):

- column-parallel base (q/k/v, gate/up, the output head): lora_A [R, I] replicated, lora_B
  [O, R] sharded on its output rows like the base weight; the adapter reads the same gathered
  input as the base and its output columns are the rank's columns;
- row-parallel base (o_proj, down_proj): lora_A [R, I] sharded on its input columns like the
  base weight, lora_B replicated; each rank's B·(A_r x_r) is a partial sum added to the base's
  partial output before the same all-reduce (or sequence-parallel reduce-scatter);
- packed projections ([q; k; v], [gate; up]) and replicated KV heads (`SlicedColwise`): the
  weight and B stored row-sharded (Shard(0)) in global row order, A replicated; each forward
  fetches this rank's rows of [W | b | B] in one all-to-all, and backward returns their gradients
  to the rows' owners.

Gradients follow Megatron's conjugate collectives: a replicated tensor that each rank uses for
different output columns gets its gradient summed over the TP group. LoRA dropout on a replicated
input draws the same mask on every TP rank (a seed broadcast from TP rank 0 per call), so the
ranks see one dropped input as one process would; recompute replays it from the restored RNG.

The base weights keep the placements of the plain TP plan (so checkpoints and DCP resharding
work unchanged) and their `requires_grad`: DTensor's parallel styles re-create parameters as
trainable, which would unfreeze the base of a LoRA / BitFit / prefix run. Prefix keys and values
[P, K, D] are sharded over the KV heads (Shard(1)) when K divides over the ranks, else kept whole
with each rank reading its replicated head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.lora import LoraLinear
from models.peft_methods import PrefixAttention
from parallel.collectives import (
    RowExchange,
    copy_to_group,
    gather_rows,
    gather_sequence,
    reduce_from_group,
    reduce_scatter_sequence,
)

_COLWISE_KINDS = ("colwise", "colwise_loss_parallel")
_SLICED_KINDS = ("colwise_packed_qkv", "colwise_packed_gate_up", "kv_replicated")


def _local(param: torch.Tensor) -> torch.Tensor:
    return cast(DTensor, param).to_local()


def _distribute(module: nn.Module, leaf: str, mesh: DeviceMesh, placement: Placement) -> None:
    """Hold `module.<leaf>` as a DTensor parameter with `placement`, keeping `requires_grad`."""
    param = getattr(module, leaf)
    if param is None:
        return
    shared = distribute_tensor(param.data, mesh, [placement])
    module.register_parameter(leaf, nn.Parameter(shared, param.requires_grad))


def shared_dropout(x: torch.Tensor, p: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Dropout with one mask on every rank of `group` (for an input the ranks replicate)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device)
    dist.broadcast(seed, group=group, group_src=0)
    gen = torch.Generator(device=x.device).manual_seed(int(seed.item()))
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


class LoraTensorParallel(ParallelStyle):
    """Shard a `LoraLinear` like the plan's style `kind` for its base, with its adapter."""

    def __init__(
        self,
        kind: str,
        *,
        sequence_parallel: bool,
        rows_of_rank: Callable[[int, int], torch.Tensor] | None = None,
    ) -> None:
        if kind not in (*_COLWISE_KINDS, "rowwise", *_SLICED_KINDS):
            raise ValueError(f"LoRA under tensor parallelism: no adapter layout for style {kind}")
        self.kind = kind
        self.sequence_parallel = sequence_parallel
        self.rows_of_rank = rows_of_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, LoraLinear), "LoraTensorParallel applies to LoraLinear"
        if self.kind == "rowwise":
            placements = {"weight": Shard(1), "bias": Replicate(), "A": Shard(1), "B": Replicate()}
        else:
            placements = {"weight": Shard(0), "bias": Shard(0), "A": Replicate(), "B": Shard(0)}
        _distribute(module, "weight", device_mesh, placements["weight"])
        _distribute(module, "bias", device_mesh, placements["bias"])
        _distribute(module.lora_A, "weight", device_mesh, placements["A"])
        _distribute(module.lora_B, "weight", device_mesh, placements["B"])
        group = device_mesh.get_group()
        if self.kind == "rowwise":
            module.forward = self._rowwise(module, group)  # type: ignore[method-assign]
        else:
            module.forward = self._columns(module, device_mesh)  # type: ignore[method-assign]
        return module

    def _dropout(self, module: LoraLinear, x: torch.Tensor, group: Any, replicated: bool):
        drop = module.lora_dropout
        if not isinstance(drop, nn.Dropout) or not module.training or drop.p == 0:
            return x
        return shared_dropout(x, drop.p, group) if replicated else drop(x)

    def _columns(self, module: LoraLinear, mesh: DeviceMesh) -> Callable[..., Any]:
        """Column-parallel (plain, loss-parallel head, or chosen rows of row-sharded weights)."""
        group = mesh.get_group()
        exchange = None
        if self.kind in _SLICED_KINDS:
            assert self.rows_of_rank is not None, "sliced styles select rows per rank"
            exchange = RowExchange(
                self.rows_of_rank, module.out_features, mesh.get_local_rank(), mesh.size()
            ).to(module.weight.device)
        gather = self.kind == "colwise_loss_parallel" and self.sequence_parallel

        def forward(x_NI: torch.Tensor) -> torch.Tensor:
            # Every rank's columns read the whole input: its gradient is a sum over the ranks.
            x_NI = gather_sequence(x_NI, group) if gather else copy_to_group(x_NI, group)
            weight = _local(module.weight)
            bias = _local(module.bias) if module.bias is not None else None
            A_RI, B_OR = _local(module.lora_A.weight), _local(module.lora_B.weight)
            A_RI = copy_to_group(A_RI, group)
            if exchange is not None:
                # One exchange for the rows of [W | b | B] this rank computes with.
                i, r = weight.shape[1], B_OR.shape[1]
                parts = [weight, *([bias[:, None]] if bias is not None else []), B_OR]
                rows = gather_rows(torch.cat(parts, dim=1), exchange, group)
                weight, B_OR = rows[:, :i], rows[:, -r:]
                bias = rows[:, i] if bias is not None else None
            out_NO = F.linear(x_NI, weight, bias)
            if module.adapter_enabled:  # off inside `adapters_disabled` (DPO's reference)
                x_NI = self._dropout(module, x_NI.to(A_RI.dtype), group, replicated=True)
                out_NO = out_NO + F.linear(F.linear(x_NI, A_RI), B_OR) * module.scaling
            if self.kind == "colwise_loss_parallel":
                return DTensor.from_local(out_NO, mesh, [Shard(-1)], run_check=False)
            return out_NO

        return forward

    def _rowwise(self, module: LoraLinear, group: Any) -> Callable[..., Any]:
        """Row-parallel: base and adapter partial sums reduced together."""
        seq = self.sequence_parallel

        def forward(x_NI: torch.Tensor) -> torch.Tensor:
            A_RI = _local(module.lora_A.weight)
            # B multiplies a partial sum: its gradient is partial too.
            B_OR = copy_to_group(_local(module.lora_B.weight), group)
            partial_NO = F.linear(x_NI, _local(module.weight))
            if module.adapter_enabled:  # off inside `adapters_disabled` (DPO's reference)
                x_NI = self._dropout(module, x_NI.to(A_RI.dtype), group, replicated=False)
                partial_NO = partial_NO + F.linear(F.linear(x_NI, A_RI), B_OR) * module.scaling
            if seq:
                out_NO = reduce_scatter_sequence(partial_NO, group)
            else:
                out_NO = reduce_from_group(partial_NO, group)
            if module.bias is not None:
                bias = _local(module.bias)
                # Under sequence parallelism each rank adds it to other tokens.
                out_NO = out_NO + (copy_to_group(bias, group) if seq else bias)
            return out_NO

        return forward


def lora_styles(
    model: nn.Module,
    resolved: dict[str, str],
    module_plan: dict[str, ParallelStyle],
    *,
    sequence_parallel: bool,
) -> dict[str, ParallelStyle]:
    """Replacement styles for the plan's `LoraLinear` modules (module name -> style)."""
    out: dict[str, ParallelStyle] = {}
    for name, kind in resolved.items():
        if name not in module_plan or not isinstance(model.get_submodule(name), LoraLinear):
            continue
        rows = getattr(module_plan[name], "rows_of_rank", None)
        out[name] = LoraTensorParallel(kind, sequence_parallel=sequence_parallel, rows_of_rank=rows)
    return out


def parallelize_with_adapters(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    module_plan: dict[str, ParallelStyle],
    resolved: dict[str, str],
    *,
    sequence_parallel: bool,
) -> None:
    """`parallelize_module` that keeps adapters sharded with their layers and frozen flags.

    LoRA layers get `LoraTensorParallel` in place of their base's style, prefix tensors are split
    over the KV heads, and every parameter's `requires_grad` is what it was before.
    """
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    module_plan = {
        **module_plan,
        **lora_styles(model, resolved, module_plan, sequence_parallel=sequence_parallel),
    }
    parallelize_module(model, tp_mesh, module_plan)
    shard_prefixes(model, tp_mesh)
    for name, param in model.named_parameters():
        if name in trainable:
            param.requires_grad_(trainable[name])


def shard_prefixes(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split each prefix-tuning layer's key/value prefixes [P, K, D] over the TP rank's KV heads."""
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()
    group = tp_mesh.get_group()
    for module in model.modules():
        if not isinstance(module, PrefixAttention):
            continue
        kv_heads = module.prefix_key.shape[1]
        split = kv_heads % size == 0
        for leaf in ("prefix_key", "prefix_value"):
            _distribute(module, leaf, tp_mesh, Shard(1) if split else Replicate())
        if split:
            module.prefix_key_value = _sharded_prefix(module)  # type: ignore[method-assign]
        else:
            head = torch.tensor([rank * kv_heads // size], device=module.prefix_key.device)
            module.prefix_key_value = _replicated_prefix(module, head, group)  # type: ignore[method-assign]


def _sharded_prefix(module: Any) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def prefix_key_value() -> tuple[torch.Tensor, torch.Tensor]:
        return _local(module.prefix_key), _local(module.prefix_value)

    return prefix_key_value


def _replicated_prefix(
    module: Any, head: torch.Tensor, group: Any
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """More ranks than KV heads: each rank reads its (replicated) head of the whole prefix; the
    head's gradient is a sum over the ranks sharing it."""

    def prefix_key_value() -> tuple[torch.Tensor, torch.Tensor]:
        key = copy_to_group(_local(module.prefix_key), group).index_select(1, head)
        value = copy_to_group(_local(module.prefix_value), group).index_select(1, head)
        return key, value

    return prefix_key_value
