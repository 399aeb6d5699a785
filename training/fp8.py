"""--fp8 tensorwise|rowwise: the decoder layers' linear matmuls in FP8 (kernels/fp8_linear.py).

`check_fp8(config)` refuses the combinations FP8 linears do not support, naming the flags, before
any model is built; `apply_fp8(model, config)` swaps, in place, every `nn.Linear` inside a decoder
layer for an `Fp8Linear` holding the same `weight` and `bias` parameters — checkpoints,
optimizers, master weights and exports see an ordinary model, so an FP8 run's checkpoint
converts like any other. Left in their own precision: the embedding and output head (what
FP8 recipes keep in high precision: the logits feed the loss directly), MoE routers (their
top-k choice is sensitive to rounding) and MoE experts (grouped weights, not linears).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.fp8_linear import GRAD_DTYPES, Fp8Linear, fp8_shape_problem, rowwise_supported
from models.moe import MoE

if TYPE_CHECKING:
    from training.config import TrainingConfig


def check_fp8(config: TrainingConfig) -> None:
    """ValueError naming the flags when --fp8 meets a layout or method it does not combine with."""
    recipe = config.precision.fp8
    if recipe is None:
        return
    flag = f"--fp8 {recipe}"
    par = config.parallel
    layout = {
        "--tensor-model-parallel-size": par.tensor_model_parallel_size > 1,
        "--pipeline-model-parallel-size": par.pipeline_model_parallel_size > 1,
    }
    bad = [name for name, on in layout.items() if on]
    if bad:
        raise ValueError(
            f"{flag} casts each whole decoder linear to FP8; it does not combine with "
            f"{', '.join(bad)} (sharded or staged linears): use data parallelism (any "
            f"--zero-stage, --hsdp) with --context-parallel-size as needed, or drop --fp8"
        )
    method = config.peft.peft_method
    if method is not None:
        raise ValueError(
            f"{flag} trains the decoder linears' weights in FP8 matmuls; --peft-method {method} "
            "freezes them: drop one (a frozen quantized base is --base-quant)"
        )


def apply_fp8(model: nn.Module, config: TrainingConfig) -> list[str]:
    """Turn the decoder linears of the freshly built `model` into FP8 linears (--fp8); returns
    their module names. ValueError naming the layer whose shape FP8 matmuls cannot take."""
    precision = config.precision
    if precision.fp8 is None:
        return []

    grad_dtype = GRAD_DTYPES[precision.fp8_grad_dtype_name()]
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not name.startswith("layers."):
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if isinstance(owner, MoE):  # routers stay in their precision
            continue
        device = module.weight.device.type
        if precision.fp8 == "rowwise" and device != "meta" and not rowwise_supported(device):
            raise ValueError(
                f"--fp8 rowwise: this torch's FP8 matmul on {device} takes per-tensor scales "
                f"only (torch {torch.__version__}); use --fp8 tensorwise, or torch 2.13 or newer"
            )
        problem = fp8_shape_problem(module)
        if problem is not None:
            raise ValueError(
                f"--fp8 {precision.fp8}: {name} has {problem} (FP8 matmuls need both "
                "dimensions of every decoder linear divisible by 16); choose such sizes or drop --fp8"
            )
        names.append(name)
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, leaf, Fp8Linear(getattr(owner, leaf), precision.fp8, grad_dtype))
    return names
