"""Every flag of ModelLink's README scripts and Megatron-LM's GPT/Llama pretraining examples is
accepted with Megatron's meaning, accepted and mapped, or refused naming the Meshline equivalent."""

from __future__ import annotations

import dataclasses
import json

import pytest

from models.config import ModelConfig
from services.common import megatron_flags
from services.trainer.arguments import field_index, parse_args
from training.setup import build_model_config

# Flags as they appear in ModelLink's README / example scripts and Megatron-LM's
# examples/pretrain_gpt.sh, examples/gpt3/train_gpt3_175b_distributed.sh and
# examples/llama/train_llama3_8b_*.sh, with a value each takes.
SCRIPT_FLAGS: dict[str, tuple[str, ...]] = {
    # model
    "--num-layers": ("2",), "--hidden-size": ("64",), "--ffn-hidden-size": ("128",),
    "--num-attention-heads": ("4",), "--seq-length": ("32",),
    "--max-position-embeddings": ("32",), "--position-embedding-type": ("rope",),
    "--normalization": ("RMSNorm",), "--norm-epsilon": ("1e-6",), "--swiglu": (),
    "--untie-embeddings-and-output-weights": (), "--disable-bias-linear": (),
    "--group-query-attention": (), "--num-query-groups": ("2",), "--rotary-base": ("500000",),
    "--make-vocab-size-divisible-by": ("1",), "--kv-channels": ("16",),
    "--init-method-std": ("0.01",), "--attention-dropout": ("0.0",),
    "--hidden-dropout": ("0.0",), "--use-rotary-position-embeddings": (),
    "--no-position-embedding": (), "--rotary-percent": ("1.0",), "--attention-backend": ("auto",),
    "--use-mcore-models": (), "--transformer-impl": ("local",), "--layernorm-epsilon": ("1e-6",),
    # kernels / fusion
    "--use-flash-attn": (), "--triangle-attn": (), "--use-fused-rmsnorm": (),
    "--use-fused-rotary-pos-emb": (), "--use-fused-swiglu": (), "--mlp-layer-fusion": (),
    "--no-masked-softmax-fusion": (), "--attention-softmax-in-fp32": (),
    "--no-gradient-accumulation-fusion": (), "--no-bias-gelu-fusion": (),
    "--no-bias-dropout-fusion": (), "--no-bias-swiglu-fusion": (), "--no-rope-fusion": (),
    "--cross-entropy-loss-fusion": (), "--no-async-tensor-model-parallel-allreduce": (),
    # batch / schedule / optimizer
    "--micro-batch-size": ("2",), "--global-batch-size": ("4",),
    "--rampup-batch-size": ("2", "2", "8"), "--train-iters": ("8",), "--lr-decay-iters": ("8",),
    "--train-samples": ("32",), "--lr-decay-samples": ("32",), "--lr-warmup-samples": ("4",),
    "--lr": ("1e-3",), "--min-lr": ("1e-5",), "--lr-decay-style": ("cosine",),
    "--lr-warmup-fraction": (".01",), "--lr-warmup-iters": ("1",), "--weight-decay": ("1e-2",),
    "--clip-grad": ("1.0",), "--adam-beta1": ("0.9",), "--adam-beta2": ("0.95",),
    "--adam-eps": ("1e-8",), "--optimizer": ("adam",), "--seed": ("42",),
    "--initial-loss-scale": ("65536",), "--fp16": (), "--bf16": (), "--release-fp32-grad": (),
    "--accumulate-allreduce-grads-in-fp32": (), "--fp16-lm-cross-entropy": (),
    "--grad-reduce-in-bf16": (), "--calculate-per-token-loss": (), "--decoupled-lr": ("5e-4",),
    "--decoupled-min-lr": ("1e-5",), "--apply-layernorm-1p": (),
    "--fp8-format": ("hybrid",), "--fp8-amax-history-len": ("1024",),
    "--fp8-amax-compute-algo": ("max",), "--fp8-param-gather": (), "--fp8-recipe": ("tensorwise",),
    "--fp8-margin": ("0",),
    # parallelism and recompute
    "--tensor-model-parallel-size": ("1",), "--pipeline-model-parallel-size": ("1",),
    "--sequence-parallel": (), "--context-parallel-size": ("1",),
    "--num-layers-per-virtual-pipeline-stage": ("1",),
    "--virtual-pipeline-model-parallel-size": ("1",), "--use-distributed-optimizer": (),
    "--overlap-grad-reduce": (), "--overlap-param-gather": (),
    "--no-overlap-p2p-communication": (), "--overlap-p2p-communication": (),
    "--optimized-pipeline": (), "--manual-mbs": ("example-config-1",), "--fold-mode": ("aiao",),
    "--checkpoint-activations": (), "--checkpoint-policy": ("block",),
    "--checkpoint-block-layer": ("1",), "--recompute-activations": (),
    "--recompute-granularity": ("full",), "--recompute-method": ("uniform",),
    "--recompute-num-layers": ("1",), "--auto-recompute-device-size": ("1024",),
    "--auto-recompute-profiling-step": ("5",), "--distributed-backend": ("nccl",),
    "--DDP-impl": ("local",), "--local_rank": ("0",), "--deepspeed": (),
    "--deepspeed-activation-checkpointing": (), "--partition-activations": (),
    "--zero-stage": ("2",), "--use-mc2": (), "--reuse-fp32-param": (), "--jit-compile": (),
    "--distributed-timeout-minutes": ("60",), "--use-cpu-initialization": (),
    "--empty-unused-memory-level": ("1",), "--manual-gc": (), "--manual-gc-interval": ("10",),
    # data and tokenizer
    "--data-path": ("PREFIX",), "--split": ("949,50,1",), "--data-impl": ("mmap",),
    "--dataset-impl": ("mmap",), "--mock-data": (), "--tokenizer-type": ("PretrainedFromHF",),
    "--tokenizer-name-or-path": ("TOK",), "--tokenizer-model": ("tok.model",),
    "--tokenizer-not-use-fast": (), "--vocab-size": ("512",), "--pad-vocab-size-to": ("512",),
    "--vocab-file": ("gpt2-vocab.json",), "--merge-file": ("gpt2-merges.txt",),
    "--is-instruction-dataset": (), "--variable-seq-lengths": (), "--num-workers": ("2",),
    "--no-create-attention-mask-in-dataloader": (), "--no-shared-storage": (),
    "--reset-position-ids": (), "--reset-attention-mask": (), "--eod-mask-loss": (),
    # checkpoints, logging, run
    "--save": ("ckpt",), "--load": ("ckpt",), "--save-interval": ("4",),
    "--no-load-optim": (), "--no-load-rng": (), "--finetune": (), "--no-save-optim": (),
    "--no-save-rng": (), "--exit-on-missing-checkpoint": (), "--use-checkpoint-args": (),
    "--use-dist-ckpt": (), "--ckpt-format": ("torch_dist",), "--exit-signal-handler": (),
    "--exit-interval": ("100",), "--exit-duration-in-mins": ("230",),
    "--log-interval": ("1",), "--eval-interval": ("4",), "--eval-iters": ("1",),
    "--tensorboard-dir": ("tb",), "--log-throughput": (), "--log-params-norm": (),
    "--log-num-zeros-in-grad": (), "--log-timers-to-tensorboard": (),
    "--log-validation-ppl-to-tensorboard": (), "--log-memory-to-tensorboard": (),
    "--log-batch-size-to-tensorboard": (), "--timing-log-level": ("0",),
    "--tensorboard-log-interval": ("1",), "--tensorboard-queue-size": ("5",),
    "--wandb-project": ("p",), "--wandb-exp-name": ("e",), "--profile": (),
    "--profile-step-start": ("4",), "--profile-step-end": ("6",), "--profile-ranks": ("0",),
    "--use-pytorch-profiler": (), "--profile-level": ("level1",), "--profile-with-cpu": (),
    "--profile-with-stack": (), "--profile-with-memory": (), "--profile-record-shapes": (),
    "--profile-save-path": ("prof",),
    "--no-check-for-nan-in-loss-and-grad": (),
    # LoRA (ModelLink)
    "--lora-target-modules": ("query_key_value", "dense", "gate_proj", "dense_h_to_4h",
                              "dense_4h_to_h"),
    "--lora-r": ("8",), "--lora-alpha": ("16",),
    "--lora-modules-to-save": ("word_embeddings", "output_layer"),
    "--lora-register-forward-hook": ("word_embeddings", "input_layernorm"), "--lora-load": ("a",),
}  # fmt: skip

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--train-iters", "8", "--eval-interval", "0"]  # fmt: skip


def _field_flags() -> set[str]:
    from services.trainer.arguments import ALIASES

    return {"--" + n.replace("_", "-") for n in field_index()} | set(ALIASES)


def _classify(flag: str) -> str:
    table = megatron_flags.by_flag()
    if flag in table:
        return table[flag].kind
    if flag in _field_flags() or flag == "--recompute-activations":
        return "field"
    raise AssertionError(f"{flag} is neither a training field nor in the Megatron flag table")


# Flags that need company to be valid on their own (checked in their own tests below).
NEEDS = {
    "--train-samples": ["--global-batch-size", "4"],
    "--lr-decay-samples": ["--global-batch-size", "4"],
    "--lr-warmup-samples": ["--global-batch-size", "4"],
    "--virtual-pipeline-model-parallel-size": ["--pipeline-model-parallel-size", "2"],
    "--no-load-optim": ["--load", "x"], "--no-load-rng": ["--load", "x"],
    "--finetune": ["--load", "x"], "--exit-on-missing-checkpoint": ["--load", "x"],
    "--save-interval": ["--save", "x"], "--release-fp32-grad": ["--bf16"],
    "--sequence-parallel": ["--tensor-model-parallel-size", "2"],
    "--num-layers-per-virtual-pipeline-stage": ["--pipeline-model-parallel-size", "2"],
    "--recompute-method": ["--recompute-granularity", "full"],
    "--auto-recompute-profiling-step": ["--auto-recompute-device-size", "1024"],
    "--data-path": ["--tokenizer-type", "PretrainedFromHF"],
    "--group-query-attention": ["--num-query-groups", "2"],
    "--rampup-batch-size": ["--global-batch-size", "8"],
    "--lora-load": [],
    "--profile": ["--profile-step-start", "2", "--profile-step-end", "4"],
    "--profile-step-end": ["--profile-step-start", "4"],
    "--lora-modules-to-save": ["--lora-target-modules", "dense"],
    "--fp8-format": ["--bf16"], "--fp8-recipe": ["--bf16"],
    "--fp8-amax-history-len": ["--bf16", "--fp8-format", "hybrid"],
    "--fp8-amax-compute-algo": ["--bf16", "--fp8-format", "hybrid"],
    "--fp8-margin": ["--bf16", "--fp8", "tensorwise"],
}  # fmt: skip
SKIP_BASE = {"--mock-data", "--data-path", "--lora-load"}  # conflict with --mock-data / need data
# Value flags accepted at Meshline's behaviour (0) and refused, naming the flag, at the
# scripts' other values.
VALUE_REFUSED = {
    "--empty-unused-memory-level", "--num-workers", "--manual-gc-interval",
    "--fp8-amax-history-len",
}  # fmt: skip
ACCEPTED_VALUE = {"--fp8-amax-history-len": "1"}
"""The value a VALUE_REFUSED flag is accepted at, where it is not 0."""


@pytest.mark.parametrize("flag", sorted(SCRIPT_FLAGS))
def test_every_script_flag_is_accepted_mapped_or_refused(flag, capsys):
    kind = _classify(flag)
    base = [a for a in BASE if a != "--mock-data"] if flag in SKIP_BASE else BASE
    argv = [*base, *NEEDS.get(flag, []), flag, *SCRIPT_FLAGS[flag]]
    if kind == "refuse" or flag in VALUE_REFUSED:
        with pytest.raises(ValueError) as caught:
            parse_args(argv)
        row = megatron_flags.by_flag()[flag]
        message = str(caught.value)
        assert flag in message and "\n" not in message
        assert row.note in message or "drop the flag" in message
        if flag in VALUE_REFUSED:
            accepted = ACCEPTED_VALUE.get(flag, "0")
            assert parse_args([*base, *NEEDS.get(flag, []), flag, accepted]) is not None
        return
    config = parse_args(argv)
    err = capsys.readouterr().err
    assert "accepted without effect" not in err, err
    assert config is not None


def test_the_table_is_data_with_one_row_per_flag_and_a_reason():
    table = megatron_flags.by_flag()
    fields = _field_flags()
    for row in megatron_flags.TABLE:
        assert row.note.strip(), row.flag
        assert row.flag not in fields, f"{row.flag} is a field flag and a table row"
        assert row.kind in ("map", "same", "refuse"), f"{row.flag}: {row.kind}"
        if row.kind == "map":
            assert row.sets or row.convert, row.flag
    assert len(table) >= len(megatron_flags.TABLE)


@pytest.mark.parametrize(
    ("extra", "section", "field", "value"),
    [
        (["--checkpoint-activations"], "parallel", "recompute_granularity", "full"),
        (["--checkpoint-policy", "block"], "parallel", "recompute_method", "block"),
        (["--checkpoint-block-layer", "1"], "parallel", "recompute_num_layers", 1),
        (["--triangle-attn"], "arch", "attention_backend", "blockwise"),
        (["--use-flash-attn"], "arch", "attention_backend", "auto"),
        (["--data-impl", "infer"], "data", "data_format", "auto"),
        (["--global-batch-size", "4", "--train-samples", "30"], "run", "train_iters", 8),
        (["--global-batch-size", "4", "--lr-decay-samples", "16"], "optim", "lr_decay_iters", 4),
        (["--pad-vocab-size-to", "384"], "model", "vocab_size", 384),
        (["--layernorm-epsilon", "1e-6"], "arch", "norm_epsilon", 1e-6),
        (["--tensorboard-dir", "tb"], "run", "log_dir", "tb"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "data", "tokenizer_type",
         "PretrainedFromHF"),
        (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "1"],
         "parallel", "num_layers_per_virtual_pipeline_stage", 1),
    ],
)  # fmt: skip
def test_mapped_flags_set_their_fields(extra, section, field, value):
    config = parse_args([*BASE, *extra])
    assert getattr(getattr(config, section), field) == value


def test_deepspeed_config_maps_its_zero_stage_and_precision(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                              "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5}))  # fmt: skip
    config = parse_args([*BASE, "--deepspeed", "--deepspeed_config", str(ds)], read_files=True)
    assert config.parallel.zero_stage == 2 and config.precision.bf16
    assert config.batch.micro_batch_size == 2 and config.optim.clip_grad == 0.5
    with pytest.raises(ValueError, match=r"--deepspeed-config .*no such file"):
        parse_args([*BASE, "--deepspeed-config", str(tmp_path / "missing.json")], read_files=True)
    # Not read where paths are untrusted (the trainer service parses with read_files=False).
    with pytest.raises(ValueError, match=r"--deepspeed-config names a file.*--zero-stage"):
        parse_args([*BASE, "--deepspeed-config", str(ds)])


def test_a_mapped_flag_contradicting_an_explicit_one_names_both():
    with pytest.raises(ValueError, match=r"--checkpoint-activations.*--recompute-granularity"):
        parse_args([*BASE, "--checkpoint-activations", "--recompute-granularity", "selective"])


def test_checkpoint_activations_with_adaptive_recompute_names_the_flag_to_drop():
    with pytest.raises(ValueError, match=r"drop --checkpoint-activations"):
        parse_args([*BASE, "--checkpoint-activations", "--auto-recompute-device-size", "1024"])


# Every row that was "accepted without effect" before and its decision (docs/decisions.md,
# "Megatron/ModelLink compat rows: no flag without effect"): same (Meshline behaves so), a
# mapped value, or refused naming the equivalent.
FORMER_NO_EFFECT = {
    "--deepspeed": "same", "--deepspeed-activation-checkpointing": "same",
    "--partition-activations": "refuse", "--optimized-pipeline": "refuse",
    "--manual-mbs": "refuse", "--fold-mode": "refuse", "--use-mc2": "refuse",
    "--reuse-fp32-param": "refuse", "--jit-compile": "refuse",
    "--overlap-param-gather": "refuse", "--overlap-p2p-communication": "refuse",
    "--grad-reduce-in-bf16": "refuse", "--no-masked-softmax-fusion": "same",
    "--no-bias-gelu-fusion": "same", "--no-bias-swiglu-fusion": "same",
    "--no-bias-dropout-fusion": "same", "--no-rope-fusion": "same",
    "--no-gradient-accumulation-fusion": "same", "--cross-entropy-loss-fusion": "same",
    "--no-async-tensor-model-parallel-allreduce": "same", "--fp16-lm-cross-entropy": "refuse",
    "--calculate-per-token-loss": "same", "--no-shared-storage": "same", "--num-workers": "map",
    "--manual-gc": "refuse", "--manual-gc-interval": "map",
    "--empty-unused-memory-level": "map", "--distributed-timeout-minutes": "refuse",
    "--no-check-for-nan-in-loss-and-grad": "refuse", "--log-params-norm": "refuse",
    "--log-num-zeros-in-grad": "refuse", "--log-timers-to-tensorboard": "refuse",
    "--log-validation-ppl-to-tensorboard": "same", "--log-memory-to-tensorboard": "refuse",
    "--log-batch-size-to-tensorboard": "refuse", "--timing-log-level": "map",
    "--tensorboard-log-interval": "map", "--tensorboard-queue-size": "refuse",
    "--wandb-project": "refuse", "--wandb-exp-name": "refuse", "--use-checkpoint-args": "refuse",
}  # fmt: skip


@pytest.mark.parametrize("flag", sorted(FORMER_NO_EFFECT))
def test_no_compat_row_is_accepted_without_effect(flag, capsys):
    row = megatron_flags.by_flag()[flag]
    assert row.kind == FORMER_NO_EFFECT[flag]
    values = {0: [], 1: ["0" if row.convert else "x"]}.get(row.nargs, ["x"])  # type: ignore[call-overload]
    if flag == "--tensorboard-log-interval":
        values = ["5"]
    argv = [*BASE, flag, *values]
    if row.kind == "refuse":
        with pytest.raises(ValueError, match="^" + flag + " .*not supported: "):
            parse_args(argv)
        return
    config = parse_args(argv)
    assert "accepted without effect" not in capsys.readouterr().err
    if flag == "--tensorboard-log-interval":
        assert config.run.log_interval == 5
        with pytest.raises(ValueError, match=r"--tensorboard-log-interval.*--log-interval"):
            parse_args([*argv, "--log-interval", "7"])
    if row.kind == "map" and row.convert and flag != "--tensorboard-log-interval":
        with pytest.raises(ValueError, match=f"{flag} 3 is not supported: .*(use|drop)"):
            parse_args([*BASE, flag, "3"])


def test_megatron_architecture_flags_define_the_model_without_model():
    llama = [*BASE, "--ffn-hidden-size", "96", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "500000",
             "--max-position-embeddings", "64"]  # fmt: skip
    cfg = build_model_config(parse_args(llama), tokenizer_vocab=300)
    assert (cfg.norm_type, cfg.norm_eps, cfg.activation) == ("rmsnorm", 1e-6, "swiglu")
    assert (cfg.attention_bias, cfg.mlp_bias, cfg.tie_word_embeddings) == (False, False, False)
    assert (cfg.kv_heads, cfg.rope_theta, cfg.ffn_hidden_size) == (2, 500000.0, 96)
    assert cfg.max_position_embeddings == 64 and cfg.vocab_size == 384  # 300 padded to 128
    # Megatron's defaults for what is left out: LayerNorm, GeLU with 4h, biases, tied output.
    gpt = build_model_config(parse_args([*BASE, "--position-embedding-type", "alibi",
                                         "--make-vocab-size-divisible-by", "64"]), 300)  # fmt: skip
    assert (gpt.norm_type, gpt.activation, gpt.ffn_hidden_size) == ("layernorm", "gelu_exact", 256)
    assert gpt.attention_bias and gpt.mlp_bias and gpt.tie_word_embeddings
    assert gpt.position_embedding == "alibi" and gpt.vocab_size == 320
    # --group-query-attention alone: Megatron's default of one query group.
    mqa = build_model_config(parse_args([*BASE, "--position-embedding-type", "rope",
                                         "--group-query-attention"]))  # fmt: skip
    assert mqa.kv_heads == 1


def test_no_position_embedding_type_without_model_is_megatrons_gpt():
    # Megatron's default model (pretrain_gpt.py): learned absolute positions, LayerNorm, exact
    # GeLU, biases, tied output layer: the "gpt" family (HF GPT-2).
    for argv in (BASE, [*BASE, "--position-embedding-type", "learned_absolute"]):
        gpt = build_model_config(parse_args([*argv, "--max-position-embeddings", "64"]), 300)
        assert (gpt.family, gpt.position_embedding, gpt.activation) == (
            "gpt",
            "learned",
            "gelu_exact",
        )
        assert (gpt.norm_type, gpt.attention_bias, gpt.mlp_bias) == ("layernorm", True, True)
        assert gpt.tie_word_embeddings and gpt.max_position_embeddings == 64
    untied = build_model_config(parse_args([*BASE, "--openai-gelu",
                                            "--untie-embeddings-and-output-weights"]))  # fmt: skip
    assert untied.activation == "gelu" and not untied.tie_word_embeddings
    with pytest.raises(ValueError, match="--position-embedding-type none is not supported"):
        parse_args([*BASE, "--position-embedding-type", "none"])


def test_model_shorthand_fills_the_same_fields_and_conflicts_name_both():
    same = build_model_config(parse_args(["--model", "tiny-llama", "--mock-data", "--swiglu",
                                          "--normalization", "RMSNorm",
                                          "--disable-bias-linear"]))  # fmt: skip
    assert same.activation == "swiglu" and same.norm_type == "rmsnorm"
    with pytest.raises(ValueError) as caught:
        build_model_config(parse_args(["--model", "tiny-llama", "--mock-data",
                                       "--normalization", "LayerNorm"]))  # fmt: skip
    assert "--normalization LayerNorm" in str(caught.value) and "--model tiny-llama" in str(
        caught.value
    )
    kv8 = parse_args([*BASE, "--position-embedding-type", "rope", "--kv-channels", "8"])
    if "kv_channels" in {f.name for f in dataclasses.fields(ModelConfig)}:
        assert build_model_config(kv8).head_dim == 8  # models with an explicit head width
    else:
        with pytest.raises(ValueError, match=r"--kv-channels 8 .*16"):
            build_model_config(kv8)


def test_no_position_embedding_is_refused_where_the_model_has_a_table():
    rope = build_model_config(parse_args([*BASE, "--use-rotary-position-embeddings",
                                          "--no-position-embedding"]))  # fmt: skip
    assert rope.position_embedding == "rope"
    with pytest.raises(ValueError, match="--no-position-embedding without --position-embedding"):
        build_model_config(parse_args([*BASE, "--no-position-embedding"]))
    with pytest.raises(ValueError, match="contradicts --position-embedding-type learned_absolute"):
        parse_args([*BASE, "--no-position-embedding", "--position-embedding-type",
                    "learned_absolute"])  # fmt: skip
