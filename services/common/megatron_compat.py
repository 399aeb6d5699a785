"""ModelLink's evaluation / generation script flags for `meshline evaluate` and `meshline generate`.

ModelLink's `evaluation_llama.py` and `generate_llama.sh` describe the model and its parallel
layout with training flags (`--num-layers 32 --hidden-size 4096 ... --tensor-model-parallel-size
2 --fp16`). Meshline reads the architecture from the checkpoint's `model_config.json` and runs one
process, so these flags are accepted and have no effect: `report()` prints one warning line
naming them. The tokenizer and precision flags are mapped by each CLI (`--tokenizer-name-or-path`
is `--tokenizer`, `--fp16` is `--dtype float16`).
"""

from __future__ import annotations

import argparse
import sys

DEST_PREFIX = "modellink__"

# flag -> nargs (0: a switch). Each is accepted without effect (why: NO_EFFECT_REASON).
MODEL_FLAGS: dict[str, int | str] = {
    "--num-layers": 1,
    "--hidden-size": 1,
    "--ffn-hidden-size": 1,
    "--num-attention-heads": 1,
    "--max-position-embeddings": 1,
    "--seq-length": 1,
    "--position-embedding-type": 1,
    "--normalization": 1,
    "--norm-epsilon": 1,
    "--layernorm-epsilon": 1,
    "--swiglu": 0,
    "--untie-embeddings-and-output-weights": 0,
    "--disable-bias-linear": 0,
    "--add-qkv-bias": 0,
    "--group-query-attention": 0,
    "--num-query-groups": 1,
    "--kv-channels": 1,
    "--rotary-base": 1,
    "--make-vocab-size-divisible-by": 1,
    "--pad-vocab-size-to": 1,
    "--vocab-size": 1,
    "--init-method-std": 1,
    "--hidden-dropout": 1,
    "--attention-dropout": 1,
    "--use-rotary-position-embeddings": 0,
    "--no-position-embedding": 0,
    "--lora-target-modules": "+",
    "--lora-r": 1,
    "--lora-alpha": 1,
    "--lora-modules-to-save": "+",
    "--lora-register-forward-hook": "*",
}
RUNTIME_FLAGS: dict[str, int | str] = {
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--sequence-parallel": 0,
    "--micro-batch-size": 1,
    "--fp16": 0,
    "--bf16": 0,
    "--global-batch-size": 1,
    "--tokenizer-type": 1,
    "--tokenizer-not-use-fast": 0,
    "--use-flash-attn": 0,
    "--triangle-attn": 0,
    "--use-fused-rmsnorm": 0,
    "--use-fused-rotary-pos-emb": 0,
    "--use-fused-swiglu": 0,
    "--mlp-layer-fusion": 0,
    "--no-masked-softmax-fusion": 0,
    "--no-gradient-accumulation-fusion": 0,
    "--attention-softmax-in-fp32": 0,
    "--no-load-optim": 0,
    "--no-load-rng": 0,
    "--exit-on-missing-checkpoint": 0,
    "--use-checkpoint-args": 0,
    "--use-mcore-models": 0,
    "--distributed-backend": 1,
    "--DDP-impl": 1,
    "--local-rank": 1,
    "--local_rank": 1,
    "--deepspeed": 0,
    "--deepspeed-config": 1,
    "--deepspeed_config": 1,
    "--zero-stage": 1,
    "--data-impl": 1,
    "--dataset-impl": 1,
}
NO_EFFECT_REASON = (
    "the checkpoint's model_config.json defines the model and one process runs it (serve a "
    "sharded model with `meshline serve inference` and pass --endpoint)"
)


def _dest(flag: str) -> str:
    return DEST_PREFIX + flag.lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add the no-effect ModelLink flags (except `skip`, which the CLI maps itself)."""
    group = parser.add_argument_group(
        "ModelLink script flags",
        "accepted for unchanged scripts; no effect (" + NO_EFFECT_REASON + ")",
    )
    for flag, nargs in {**MODEL_FLAGS, **RUNTIME_FLAGS}.items():
        if flag in skip:
            continue
        if nargs == 0:
            group.add_argument(flag, dest=_dest(flag), action="store_true", help=argparse.SUPPRESS)
        else:
            group.add_argument(
                flag,
                dest=_dest(flag),
                nargs=None if nargs == 1 else nargs,
                default=None,
                help=argparse.SUPPRESS,
            )


def given_flags(args: argparse.Namespace) -> list[str]:
    """The no-effect flags present on the command line."""
    flags = {_dest(f): f for f in {**MODEL_FLAGS, **RUNTIME_FLAGS}}
    return [
        flags[key]
        for key, value in vars(args).items()
        if key in flags and value not in (None, False)
    ]


def report(args: argparse.Namespace, prog: str) -> list[str]:
    """Print one warning naming the no-effect flags given (if any); returns them."""
    given = given_flags(args)
    if given:
        print(
            f"{prog}: warning: accepted without effect: {' '.join(given)} ({NO_EFFECT_REASON})",
            file=sys.stderr,
        )
    return given
