"""ModelLink's evaluation / generation script flags for `meshline evaluate` and `meshline generate`.

ModelLink's `evaluation_llama.py` and `generate_llama.sh` describe the model and its parallel
layout with training flags (`--num-layers 32 --hidden-size 4096 ... --tensor-model-parallel-size
1 --fp16`). Meshline reads the architecture from the checkpoint and runs one process, so each flag
is one `CompatFlag` row (services/common/compat_flags.py), never accepted without effect:

- architecture flags are `check` rows: compared with the checkpoint's config before any weight is
  read, so a script pointed at the wrong checkpoint stops with both values named;
- `--micro-batch-size`, `--fp16`/`--bf16` are `map` rows onto the command's own settings;
- a parallel size above 1, a DeepSpeed config file and LoRA flags without `--lora-load` are
  refused, naming what to use instead;
- the rest are `same` rows: Meshline already behaves as they ask (no dropout at inference, fused
  kernels chosen per device, one process), each saying why.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from models.config import ModelConfig
from services.common import compat_flags
from services.common.compat_flags import SAME_KERNEL, CompatFlag, same_rows

Check = Callable[[Any, dict[str, Any]], dict[str, Any]]


def _model(facts: dict[str, Any]) -> ModelConfig:
    return facts["model"]


def _equal(flag: str, read: Callable[[ModelConfig], Any], parse: Callable[[Any], Any]) -> Check:
    """A check that the flag's value equals what `read` gives for the checkpoint."""

    def check(value: Any, facts: dict[str, Any]) -> dict[str, Any]:
        want, have = parse(value), read(_model(facts))
        same = math.isclose(want, have, rel_tol=1e-6) if isinstance(want, float) else want == have
        if not same:
            raise ValueError(f"{flag} {value}, but the checkpoint has {have}")
        return {}

    return check


def _holds(flag: str, test: Callable[[ModelConfig], bool], what: str) -> Check:
    """A check that a switch's statement (`what`) holds for the checkpoint."""

    def check(value: Any, facts: dict[str, Any]) -> dict[str, Any]:
        if not test(_model(facts)):
            raise ValueError(f"{flag} says {what}, but the checkpoint's model does not")
        return {}

    return check


def _seq_length(value: Any, facts: dict[str, Any]) -> dict[str, Any]:
    limit = facts.get("context_length") or _model(facts).max_position_embeddings
    if int(value) > limit:
        raise ValueError(
            f"--seq-length {value} is longer than the model's context ({limit} positions)"
        )
    return {}


def _vocab_size(value: Any, facts: dict[str, Any]) -> dict[str, Any]:
    have = _model(facts).vocab_size
    if int(value) > have:
        raise ValueError(f"--vocab-size {value}, but the checkpoint's embedding has {have} rows")
    return {}


def _kv_heads(config: ModelConfig) -> int:
    return config.num_kv_heads or config.num_attention_heads


def _head_dim(config: ModelConfig) -> int:
    return config.kv_channels or config.hidden_size // config.num_attention_heads


_NORMS = {"rmsnorm": "rmsnorm", "layernorm": "layernorm"}
_POSITIONS = {"rope": "rope", "alibi": "alibi", "learned_absolute": "learned"}


def _one_process(flag: str) -> Check:
    def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
        if int(value) != 1:
            raise ValueError(
                f"{flag} {value}: this command runs the model in one process; serve it sharded "
                f"with `meshline serve inference {flag} {value}` and pass --endpoint (evaluate) "
                "or use the OpenAI API"
            )
        return {}

    return convert


def _lora(flag: str) -> Check:
    """LoRA settings describe the adapter given by --lora-load, which carries them itself."""

    def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
        if not given.get("lora_load"):
            raise ValueError(
                f"{flag} describes a LoRA adapter, but none is given: pass --lora-load DIR "
                "(generate), or merge the adapter first with `meshline convert --lora-load`"
            )
        return {}

    return convert


def _micro_batch(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if "batch_size" in given:  # evaluate: requests per batch
        return {"batch_size": int(value)}
    if int(value) != 1:  # generate: one prompt
        raise ValueError(
            f"--micro-batch-size {value}: `meshline generate` runs one prompt; batch requests "
            "with `meshline serve inference` (continuous batching) or `meshline evaluate`"
        )
    return {}


_INT = int
_ONE_PROCESS = "one process runs the model: there is no distributed backend to choose"
_NO_TRAINING = "inference loads the weights and never the optimizer or RNG state"

TABLE: tuple[CompatFlag, ...] = (
    # --- the architecture, checked against the checkpoint
    CompatFlag("--num-layers", "check", "equals the checkpoint's layer count", nargs=1,
               convert=_equal("--num-layers", lambda c: c.num_layers, _INT)),
    CompatFlag("--hidden-size", "check", "equals the checkpoint's hidden size", nargs=1,
               convert=_equal("--hidden-size", lambda c: c.hidden_size, _INT)),
    CompatFlag("--ffn-hidden-size", "check", "equals the checkpoint's MLP width", nargs=1,
               convert=_equal("--ffn-hidden-size", lambda c: c.ffn_hidden_size, _INT)),
    CompatFlag("--num-attention-heads", "check", "equals the checkpoint's head count", nargs=1,
               convert=_equal("--num-attention-heads", lambda c: c.num_attention_heads, _INT)),
    CompatFlag("--max-position-embeddings", "check", "equals the checkpoint's positions",
               nargs=1, convert=_equal("--max-position-embeddings",
                                       lambda c: c.max_position_embeddings, _INT)),
    CompatFlag("--seq-length", "check", "fits the model's context", nargs=1,
               convert=_seq_length),
    CompatFlag("--position-embedding-type", "check", "the checkpoint's position embedding",
               nargs=1, convert=_equal("--position-embedding-type", lambda c: c.position_embedding,
                                       lambda v: _POSITIONS.get(str(v), str(v)))),
    CompatFlag("--normalization", "check", "the checkpoint's norm (RMSNorm / LayerNorm)", nargs=1,
               convert=_equal("--normalization", lambda c: c.norm_type,
                              lambda v: _NORMS.get(str(v).lower(), str(v)))),
    CompatFlag("--norm-epsilon", "check", "the checkpoint's norm epsilon", nargs=1,
               aliases=("--layernorm-epsilon",),
               convert=_equal("--norm-epsilon", lambda c: c.norm_eps, float)),
    CompatFlag("--swiglu", "check", "the checkpoint's MLP is SwiGLU",
               convert=_holds("--swiglu", lambda c: c.activation == "swiglu", "a SwiGLU MLP")),
    CompatFlag("--untie-embeddings-and-output-weights", "check", "the output head is its own",
               convert=_holds("--untie-embeddings-and-output-weights",
                              lambda c: not c.tie_word_embeddings, "an untied output head")),
    CompatFlag("--disable-bias-linear", "check", "the linear layers have no bias",
               convert=_holds("--disable-bias-linear",
                              lambda c: not (c.attention_bias or c.mlp_bias), "no linear biases")),
    CompatFlag("--add-qkv-bias", "check", "the q/k/v projections have a bias",
               convert=_holds("--add-qkv-bias", lambda c: c.qkv_bias or c.attention_bias,
                              "q/k/v biases")),
    CompatFlag("--group-query-attention", "check", "the checkpoint uses grouped-query attention",
               convert=_holds("--group-query-attention",
                              lambda c: _kv_heads(c) < c.num_attention_heads,
                              "grouped-query attention")),
    CompatFlag("--num-query-groups", "check", "equals the checkpoint's key/value heads",
               nargs=1, convert=_equal("--num-query-groups", _kv_heads, _INT)),
    CompatFlag("--kv-channels", "check", "equals the checkpoint's head dimension", nargs=1,
               convert=_equal("--kv-channels", _head_dim, _INT)),
    CompatFlag("--rotary-base", "check", "equals the checkpoint's RoPE base", nargs=1,
               convert=_equal("--rotary-base", lambda c: c.rope_theta, float)),
    CompatFlag("--use-rotary-position-embeddings", "check", "the checkpoint uses RoPE",
               convert=_holds("--use-rotary-position-embeddings",
                              lambda c: c.position_embedding == "rope", "rotary positions")),
    CompatFlag("--no-position-embedding", "check", "no learned absolute positions",
               convert=_holds("--no-position-embedding",
                              lambda c: c.position_embedding != "learned",
                              "no learned position table")),
    CompatFlag("--vocab-size", "check", "fits the checkpoint's (padded) embedding", nargs=1,
               convert=_vocab_size),
    CompatFlag("--make-vocab-size-divisible-by", "same", "the checkpoint's embedding already "
               "has its padded size; padding applies when a model is built from a tokenizer",
               nargs=1),
    CompatFlag("--pad-vocab-size-to", "same", "the checkpoint's embedding already has its "
               "padded size", nargs=1),
    CompatFlag("--init-method-std", "same", "the weights come from the checkpoint, so no "
               "initialisation applies", nargs=1),
    CompatFlag("--hidden-dropout", "same", "inference runs without dropout (as Megatron's does)",
               nargs=1),
    CompatFlag("--attention-dropout", "same", "inference runs without dropout (as Megatron's "
               "does)", nargs=1),
    # --- LoRA: the adapter's own adapter_config.json gives these
    CompatFlag("--lora-target-modules", "check", "read from the --lora-load adapter", nargs="+",
               convert=_lora("--lora-target-modules")),
    CompatFlag("--lora-r", "check", "read from the --lora-load adapter", nargs=1,
               convert=_lora("--lora-r")),
    CompatFlag("--lora-alpha", "check", "read from the --lora-load adapter", nargs=1,
               convert=_lora("--lora-alpha")),
    CompatFlag("--lora-modules-to-save", "check", "read from the --lora-load adapter", nargs="+",
               convert=_lora("--lora-modules-to-save")),
    CompatFlag("--lora-register-forward-hook", "check", "read from the --lora-load adapter",
               nargs="*", convert=_lora("--lora-register-forward-hook")),
    # --- how the run is laid out
    CompatFlag("--tensor-model-parallel-size", "map", "1 (one process); larger: serve it "
               "sharded and pass --endpoint", nargs=1,
               convert=_one_process("--tensor-model-parallel-size")),
    CompatFlag("--pipeline-model-parallel-size", "map", "1 (one process); larger: serve it "
               "sharded and pass --endpoint", nargs=1,
               convert=_one_process("--pipeline-model-parallel-size")),
    CompatFlag("--sequence-parallel", "same", "with one tensor-parallel rank sequence "
               "parallelism has nothing to split"),
    CompatFlag("--micro-batch-size", "map", "--batch-size (requests per batch); `generate` "
               "runs one prompt, so 1 there", nargs=1, convert=_micro_batch),
    CompatFlag("--global-batch-size", "same", "evaluation has no global batch: every request "
               "is scored once", nargs=1),
    CompatFlag("--fp16", "map", "--dtype float16", sets=(("dtype", "float16"),)),
    CompatFlag("--bf16", "map", "--dtype bfloat16", sets=(("dtype", "bfloat16"),)),
    CompatFlag("--tokenizer-type", "same", "the tokenizer's kind is read from its files "
               "(tokenizer.json / tokenizer.model)", nargs=1),
    CompatFlag("--tokenizer-not-use-fast", "same", "the Rust tokenizer is used; HF's slow and "
               "fast tokenizers give the same ids"),
    *same_rows(SAME_KERNEL, "--use-flash-attn", "--triangle-attn", "--use-fused-rmsnorm",
               "--use-fused-rotary-pos-emb", "--use-fused-swiglu", "--mlp-layer-fusion",
               "--no-masked-softmax-fusion"),
    CompatFlag("--no-gradient-accumulation-fusion", "same", "inference accumulates no "
               "gradients"),
    CompatFlag("--attention-softmax-in-fp32", "same", "attention softmax is computed in fp32"),
    CompatFlag("--no-load-optim", "same", _NO_TRAINING),
    CompatFlag("--no-load-rng", "same", _NO_TRAINING),
    CompatFlag("--exit-on-missing-checkpoint", "same", "a missing --load is always an error"),
    CompatFlag("--use-checkpoint-args", "same", "the architecture is always read from the "
               "checkpoint (and the architecture flags checked against it)"),
    CompatFlag("--use-mcore-models", "same", "one model implementation (models/)"),
    CompatFlag("--distributed-backend", "same", _ONE_PROCESS, nargs=1),
    CompatFlag("--DDP-impl", "same", _ONE_PROCESS, nargs=1),
    CompatFlag("--local-rank", "same", _ONE_PROCESS, nargs=1, aliases=("--local_rank",)),
    CompatFlag("--deepspeed", "same", "one process holds the whole model; ZeRO partitions "
               "training state only"),
    CompatFlag("--zero-stage", "same", "ZeRO partitions training state only", nargs=1),
    CompatFlag("--deepspeed-config", "refuse", "give its settings as flags (--dtype, "
               "--batch-size)", nargs=1, aliases=("--deepspeed_config",)),
    CompatFlag("--data-impl", "same", "task files are read as they are; mmap is the only "
               "shard implementation", nargs=1, aliases=("--dataset-impl",)),
)  # fmt: skip


@dataclass
class Resolved:
    """What the compat flags on a command line amount to."""

    settings: dict[str, Any] = field(default_factory=dict)
    """The command's own settings they map to (dest -> value)."""
    checks: list[tuple[CompatFlag, Any]] = field(default_factory=list)
    """Statements about the model, to check once its config is known."""


def add_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add the rows (except `skip`, which the command spells itself) to `parser`."""
    compat_flags.add_rows(
        parser,
        [row for row in TABLE if row.flag not in skip],
        "ModelLink script flags",
        "accepted for unchanged scripts: architecture flags are checked against the "
        "checkpoint, the rest mapped, refused or already Meshline's behaviour (see each)",
    )


def resolve(args: argparse.Namespace) -> Resolved:
    """Apply the mapped rows to `args` (a contradiction with an explicit setting, or a refused
    flag, is a ValueError naming both) and collect the checks for `check_model`."""
    resolved = Resolved()
    for row, value in compat_flags.given(args, TABLE):
        if row.kind == "refuse":
            raise ValueError(f"{row.flag} is not supported here: {row.note}")
        if row.kind == "check":
            if row.flag.startswith("--lora"):
                assert row.convert is not None
                row.convert(value, vars(args))
            else:
                resolved.checks.append((row, value))
            continue
        if row.kind == "same":
            continue
        mapped = dict(row.sets) if row.convert is None else row.convert(value, vars(args))
        for dest, new in mapped.items():
            current = getattr(args, dest, None)
            if dest in resolved.settings and resolved.settings[dest] != new:
                raise ValueError(f"{row.flag} contradicts another ModelLink flag; drop one")
            if current is not None and current not in (new, "auto"):
                raise ValueError(
                    f"{row.flag} means --{dest.replace('_', '-')} {new}, but "
                    f"--{dest.replace('_', '-')} {current} is given; drop one of them"
                )
            resolved.settings[dest] = new
            setattr(args, dest, new)
    return resolved


def check_model(resolved: Resolved, model: ModelConfig, context_length: int | None = None) -> None:
    """Compare the architecture flags with the checkpoint's config: ValueError naming each
    contradiction (all of them, so a script is fixed in one pass)."""
    facts = {"model": model, "context_length": context_length}
    problems = []
    for row, value in resolved.checks:
        assert row.convert is not None
        try:
            row.convert(value, facts)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(
            "the ModelLink flags do not describe this checkpoint: "
            + "; ".join(problems)
            + " (drop the flag or point --load at the checkpoint it describes)"
        )
