"""Flag parsing: every flag maps onto the config, --config files with overrides, clear errors."""

from __future__ import annotations

import pytest

from services.trainer.arguments import field_index, parse_args
from services.trainer.train_config import TrainConfig

# A non-default value for every training field, all consistent with each other.
# --train/valid/test-data-path replace --data-path, so they are parsed on their own.
PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")
NON_DEFAULT = {
    "pipeline_schedule": ("--pipeline-schedule", "interleaved_1f1b"),
    "auto_recompute_device_size": ("--auto-recompute-device-size", "1024"),
    "auto_recompute_profiling_step": ("--auto-recompute-profiling-step", "6"),
    "peft_method": ("--peft-method", "lora"),
    "lora_target_modules": ("--lora-target-modules", "query_key_value", "dense"),
    "lora_r": ("--lora-r", "8"),
    "lora_alpha": ("--lora-alpha", "16"),
    "lora_dropout": ("--lora-dropout", "0.1"),
    "lora_modules_to_save": ("--lora-modules-to-save", "lm_head", "norm"),
    "lora_load": ("--lora-load", "adapter-dir"),
    "num_virtual_tokens": ("--num-virtual-tokens", "4"),
    "base_quant": ("--base-quant", "nf4"),
    "model": ("--model", "tiny-llama-gqa"),
    "num_layers": ("--num-layers", "3"),
    "hidden_size": ("--hidden-size", "48"),
    "ffn_hidden_size": ("--ffn-hidden-size", "96"),
    "num_attention_heads": ("--num-attention-heads", "6"),
    "num_query_groups": ("--num-query-groups", "2"),
    "max_position_embeddings": ("--max-position-embeddings", "96"),
    "vocab_size": ("--vocab-size", "300"),
    "seq_length": ("--seq-length", "32"),
    "init_method_std": ("--init-method-std", "0.01"),
    "hidden_dropout": ("--hidden-dropout", "0.1"),
    "attention_dropout": ("--attention-dropout", "0.05"),
    "position_embedding_type": ("--position-embedding-type", "alibi"),
    "normalization": ("--normalization", "LayerNorm"),
    "norm_epsilon": ("--norm-epsilon", "1e-5"),
    "swiglu": ("--swiglu",),
    "no_position_embedding": ("--no-position-embedding",),
    "openai_gelu": ("--openai-gelu",),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights",),
    "disable_bias_linear": ("--disable-bias-linear",),
    "add_qkv_bias": ("--add-qkv-bias",),
    "group_query_attention": ("--group-query-attention",),
    "rotary_base": ("--rotary-base", "500000"),
    "make_vocab_size_divisible_by": ("--make-vocab-size-divisible-by", "64"),
    "kv_channels": ("--kv-channels", "8"),
    "attention_backend": ("--attention-backend", "blockwise"),
    "tokenizer_not_use_fast": ("--tokenizer-not-use-fast",),
    "exit_on_missing_checkpoint": ("--exit-on-missing-checkpoint",),
    "data_path": ("--data-path", "0.3", "a/b_text_document", "0.7", "c_text_document"),
    "split": ("--split", "98,1,1"),
    "train_data_path": ("--train-data-path", "t_text_document"),
    "valid_data_path": ("--valid-data-path", "v_text_document"),
    "test_data_path": ("--test-data-path", "e_text_document"),
    "data_cache_path": ("--data-cache-path", "index-cache"),
    "data_format": ("--data-format", "arrow"),
    "reset_position_ids": ("--reset-position-ids",),
    "reset_attention_mask": ("--reset-attention-mask",),
    "eod_mask_loss": ("--eod-mask-loss",),
    "mock_data": ("--mock-data",),
    "is_instruction_dataset": ("--is-instruction-dataset",),
    "variable_seq_lengths": ("--variable-seq-lengths",),
    "pack": ("--pack",),
    "tokenizer_type": ("--tokenizer-type", "SentencePiece"),
    "tokenizer_model": ("--tokenizer-model", "tok.model"),
    "tokenizer_name_or_path": ("--tokenizer-name-or-path", "hf-dir"),
    "micro_batch_size": ("--micro-batch-size", "2"),
    "global_batch_size": ("--global-batch-size", "16"),
    "rampup_batch_size": ("--rampup-batch-size", "4", "4", "64"),
    "optimizer": ("--optimizer", "cadam"),
    "lr": ("--lr", "1e-3"),
    "min_lr": ("--min-lr", "1e-5"),
    "lr_decay_style": ("--lr-decay-style", "inverse-square-root"),
    "lr_warmup_iters": None,  # exclusive with --lr-warmup-fraction: checked separately
    "lr_warmup_style": ("--lr-warmup-style", "log"),
    "lr_schedule_lag": ("--lr-schedule-lag", "1"),
    "lr_warmup_lag": ("--lr-warmup-lag", "1"),
    "lr_warmup_fraction": ("--lr-warmup-fraction", "0.1"),
    "lr_decay_iters": ("--lr-decay-iters", "50"),
    "weight_decay": ("--weight-decay", "0.1"),
    "adam_beta1": ("--adam-beta1", "0.965"),
    "adam_beta2": ("--adam-beta2", "0.95"),
    "adam_eps": ("--adam-eps", "1e-6"),
    "sgd_momentum": ("--sgd-momentum", "0.5"),
    "clip_grad": ("--clip-grad", "0.5"),
    "fp16": ("--fp16",),
    "bf16": None,  # exclusive with --fp16: checked separately
    "loss_scale": ("--loss-scale", "1024"),
    "initial_loss_scale": ("--initial-loss-scale", "65536"),
    "min_loss_scale": ("--min-loss-scale", "2"),
    "loss_scale_window": ("--loss-scale-window", "100"),
    "hysteresis": ("--hysteresis", "3"),
    "release_fp32_grad": ("--release-fp32-grad",),
    "qat": ("--qat", "int4"),
    "qat_group_size": ("--qat-group-size", "64"),
    "fp8": None,  # needs --bf16, exclusive with --qat: checked separately
    "fp8_grad_format": None,
    "train_iters": ("--train-iters", "40"),
    "eval_interval": ("--eval-interval", "20"),
    "eval_iters": ("--eval-iters", "3"),
    "save": ("--save", "ckpt"),
    "save_interval": ("--save-interval", "10"),
    "keep_last_checkpoints": ("--keep-last-checkpoints", "2"),
    "async_save": ("--async-save",),
    "load": ("--load", "old"),
    "no_load_optim": ("--no-load-optim",),
    "no_load_rng": ("--no-load-rng",),
    "finetune": ("--finetune",),
    "seed": ("--seed", "7"),
    "log_interval": ("--log-interval", "5"),
    "log_dir": ("--log-dir", "logs"),
    "peak_tflops": ("--peak-tflops", "312"),
    "nan_policy": ("--nan-policy", "skip"),
    "spike_factor": ("--spike-factor", "5"),
    "no_save_optim": ("--no-save-optim",),
    "no_save_rng": ("--no-save-rng",),
    "exit_interval": ("--exit-interval", "100"),
    "exit_duration_in_mins": ("--exit-duration-in-mins", "230.0"),
    "profile": ("--profile",),
    "profile_step_start": ("--profile-step-start", "4"),
    "profile_step_end": ("--profile-step-end", "6"),
    "profile_ranks": ("--profile-ranks", "0", "1"),
    "profile_level": ("--profile-level", "level1"),
    "profile_with_cpu": ("--profile-with-cpu",),
    "profile_with_stack": ("--profile-with-stack",),
    "profile_with_memory": ("--profile-with-memory",),
    "profile_record_shapes": ("--profile-record-shapes",),
    "profile_save_path": ("--profile-save-path", "prof"),
    "stage": ("--stage", "dpo"),
    "dpo_beta": ("--dpo-beta", "0.3"),
    "dpo_loss_type": ("--dpo-loss-type", "robust"),
    "dpo_label_smoothing": ("--dpo-label-smoothing", "0.1"),
    "ref_model": ("--ref-model", "sft"),
    "orpo_beta": ("--orpo-beta", "0.2"),  # with --stage orpo: checked below on its own
    "simpo_beta": ("--simpo-beta", "2.0"),  # with --stage simpo: checked below on their own
    "gamma_beta_ratio": ("--gamma-beta-ratio", "0.5"),
    "use_distributed_optimizer": ("--use-distributed-optimizer",),
    "zero_stage": None,  # set by --use-distributed-optimizer (checked below)
    "hsdp": ("--hsdp",),
    "hsdp_shard_size": ("--hsdp-shard-size", "2"),
    "cpu_offload": None,  # needs --zero-stage 3, checked separately
    "optimizer_cpu_offload": ("--optimizer-cpu-offload",),
    "optimizer_nvme_path": ("--optimizer-nvme-path", "swap"),
    "param_nvme_path": None,  # needs --cpu-offload (ZeRO-3): tests/parallel/test_param_swap.py
    "param_nvme_buffer_count": None,  # with --param-nvme-path: tests/parallel/test_param_swap.py
    "offload_pin_memory": ("--offload-pin-memory",),
    "overlap_grad_reduce": ("--overlap-grad-reduce",),
    "zero3_prefetch_layers": None,  # needs --zero-stage 3, checked separately
    "tensor_model_parallel_size": ("--tensor-model-parallel-size", "2"),
    "sequence_parallel": ("--sequence-parallel",),
    "pipeline_model_parallel_size": ("--pipeline-model-parallel-size", "4"),
    "num_layers_per_virtual_pipeline_stage": ("--num-layers-per-virtual-pipeline-stage", "1"),
    "decoder_first_pipeline_num_layers": None,  # needs PP without virtual stages: test_dry_run.py
    "decoder_last_pipeline_num_layers": None,
    "context_parallel_size": ("--context-parallel-size", "2"),
    "expert_model_parallel_size": None,  # excludes TP/PP/CP: tests/finetune/test_expert_parallel.py
    "num_experts": ("--num-experts", "4"),
    "moe_router_topk": ("--moe-router-topk", "1"),
    "moe_aux_loss_coeff": ("--moe-aux-loss-coeff", "0.01"),
    "moe_z_loss_coeff": ("--moe-z-loss-coeff", "0.001"),
    "recompute_granularity": ("--recompute-granularity", "full"),
    "recompute_method": ("--recompute-method", "block"),
    "recompute_num_layers": ("--recompute-num-layers", "2"),
    "compile": ("--compile",),
    "max_prompt_length": ("--max-prompt-length", "64"),
    "max_completion_length": ("--max-completion-length", "32"),
    "temperature": ("--temperature", "0.7"),
    "top_p": ("--top-p", "0.9"),
    "top_k": ("--top-k", "5"),
    "reward_funcs": ("--reward-funcs", "gsm8k", "regex"),  # lists: checked below on their own
    "reward_weights": ("--reward-weights", "0.5", "2"),
    "reward_regex": ("--reward-regex", "x+"),
    "reward_model": ("--reward-model", "rm/"),
    "num_generations": ("--num-generations", "4"),
    "beta": ("--beta", "0.04"),
    "epsilon": ("--epsilon", "0.1"),
    "epsilon_high": ("--epsilon-high", "0.28"),
    "loss_type": ("--loss-type", "grpo"),
    "scale_rewards": ("--scale-rewards", "batch"),
    "kl_coef": ("--kl-coef", "0.1"),
    "gamma": ("--gamma", "0.99"),
    "lam": ("--lam", "0.9"),
    "cliprange": ("--cliprange", "0.1"),
    "cliprange_value": ("--cliprange-value", "0.3"),
    "vf_coef": ("--vf-coef", "0.2"),
    "autotune": ("--autotune",),
    "autotune_min_micro_batch_size": ("--autotune-min-micro-batch-size", "2"),
    "autotune_max_micro_batch_size": ("--autotune-max-micro-batch-size", "16"),
    "autotune_num_micro_batch_sizes": ("--autotune-num-micro-batch-sizes", "2"),
    "autotune_zero_stages": ("--autotune-zero-stages", "1", "3"),
    "autotune_recompute": ("--autotune-recompute", "none", "full"),
    "autotune_warmup_steps": ("--autotune-warmup-steps", "1"),
    "autotune_steps": ("--autotune-steps", "4"),
    "autotune_max_trials": ("--autotune-max-trials", "7"),
    "autotune_early_stopping": ("--autotune-early-stopping", "0"),
    "autotune_memory_limit": ("--autotune-memory-limit", "2GiB"),
    "autotune_trial_timeout": ("--autotune-trial-timeout", "30"),
    "autotune_dir": ("--autotune-dir", "tuning"),
}


def _values(config: TrainConfig) -> dict:
    return {
        name: getattr(getattr(config, section), name)
        for name, (section, _) in field_index().items()
    }


def test_every_field_has_a_flag_and_parses():
    assert set(NON_DEFAULT) == set(field_index()), "add the new field to NON_DEFAULT"
    defaults = _values(TrainConfig())
    # Checked below on their own: they conflict with flags in the main argv.
    hsdp_ok = {
        "hsdp",
        "hsdp_shard_size",
        "auto_recompute_device_size",
        "auto_recompute_profiling_step",
        "simpo_beta",
        "gamma_beta_ratio",
        "orpo_beta",
        "openai_gelu",  # the other MLP activation than --swiglu
        "reward_funcs",
        "reward_weights",
        *PER_SPLIT,
    }
    argv = [a for key, flags in NON_DEFAULT.items() if flags and key not in hsdp_ok for a in flags]
    values = _values(parse_args(argv))
    for name, flags in NON_DEFAULT.items():
        if not flags or name in hsdp_ok:
            continue
        assert values[name] != defaults[name], f"{flags[0]} did not change {name}"
        if len(flags) == 2:
            assert str(values[name]) == flags[1] or values[name] == type(values[name])(flags[1])
    assert values["data_path"] == ["0.3", "a/b_text_document", "0.7", "c_text_document"]
    per_split = _values(parse_args([a for key in PER_SPLIT for a in NON_DEFAULT[key]]))
    for key in PER_SPLIT:
        assert per_split[key] == [NON_DEFAULT[key][1]], key
    assert values["rampup_batch_size"] == [4, 4, 64]
    assert values["zero_stage"] == 1  # --use-distributed-optimizer is ZeRO-1
    fsdp = parse_args(
        ["--zero-stage", "3", "--hsdp", "--hsdp-shard-size", "2", "--cpu-offload", "--bf16",
         "--zero3-prefetch-layers", "2"]
    )  # fmt: skip
    assert fsdp.parallel.zero3_prefetch_layers == 2
    simpo = parse_args(["--stage", "simpo", "--simpo-beta", "2.0", "--gamma-beta-ratio", "0.5"])
    assert (simpo.run.simpo_beta, simpo.run.gamma_beta_ratio) == (2.0, 0.5)
    assert parse_args(["--stage", "orpo", "--orpo-beta", "0.2"]).run.orpo_beta == 0.2
    assert _values(parse_args(["--openai-gelu"]))["openai_gelu"] is True
    fp8 = parse_args(["--bf16", "--fp8", "rowwise", "--fp8-grad-format", "e4m3"]).precision
    assert (fp8.fp8, fp8.fp8_grad_format) == ("rowwise", "e4m3")
    rl = parse_args([*NON_DEFAULT["reward_funcs"], *NON_DEFAULT["reward_weights"]]).rl
    assert (rl.reward_funcs, rl.reward_weights) == (["gsm8k", "regex"], [0.5, 2.0])
    assert (fsdp.parallel.zero_stage, fsdp.parallel.hsdp, fsdp.parallel.hsdp_shard_size) == (
        3,
        True,
        2,
    )
    assert fsdp.parallel.cpu_offload and fsdp.precision.bf16
    assert parse_args(["--lr-warmup-iters", "12"]).optim.lr_warmup_iters == 12
    adaptive = parse_args(
        ["--auto-recompute-device-size", "1024", "--auto-recompute-profiling-step", "6"]
    ).parallel
    assert (adaptive.auto_recompute_device_size, adaptive.auto_recompute_profiling_step) == (
        1024,
        6,
    )


def test_aliases():
    config = parse_args(["--tensorboard-dir", "tb", "--recompute-activations"])
    assert config.run.log_dir == "tb"
    assert config.parallel.recompute_granularity == "selective"


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_config_file_with_overrides(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    if suffix == ".yaml":
        path.write_text(
            "model: {model: tiny-llama, seq_length: 32}\n"
            "batch:\n  micro_batch_size: 2\n  global_batch_size: 8\n"
            "lr: 1.0e-3\nlr-decay-style: linear\nbf16: true\n"
        )
    else:
        path.write_text(
            '[model]\nmodel = "tiny-llama"\nseq_length = 32\n'
            "[batch]\nmicro_batch_size = 2\nglobal_batch_size = 8\n"
            '[optim]\nlr = 1e-3\nlr_decay_style = "linear"\n[precision]\nbf16 = true\n'
        )
    config = parse_args(["--config", str(path), "--lr", "5e-4", "--micro-batch-size", "4"])
    assert config.model.model == "tiny-llama" and config.model.seq_length == 32
    assert config.batch.micro_batch_size == 4  # the command line wins
    assert config.batch.global_batch_size == 8
    assert config.optim.lr == 5e-4 and config.optim.lr_decay_style == "linear"
    assert config.precision.bf16
    round_trip = TrainConfig.from_dict(config.to_dict())
    assert round_trip == config


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("micro_batch_sise: 2\n")
    with pytest.raises(ValueError, match="micro_batch_sise"):
        parse_args(["--config", str(bad)])
    with pytest.raises(ValueError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    weird = tmp_path / "run.json"
    weird.write_text("{}")
    with pytest.raises(ValueError, match=r"\.toml"):
        parse_args(["--config", str(weird)])


BASE = ["--model", "tiny-llama", "--mock-data"]


@pytest.mark.parametrize(
    ("argv", "world", "pattern"),
    [
        (
            ["--micro-batch-size", "3", "--global-batch-size", "8"],
            2,
            "--global-batch-size 8.*--micro-batch-size 3",
        ),
        (
            ["--pipeline-model-parallel-size", "2"],
            1,
            "--pipeline-model-parallel-size 2 .* does not divide the world size 1",
        ),
        (
            ["--auto-recompute-device-size", "100", "--auto-recompute-profiling-step", "3"],
            1,
            "--auto-recompute-profiling-step must be >= 5",
        ),
        (
            ["--lr-warmup-iters", "50", "--train-iters", "20"],
            1,
            "--lr-warmup-iters 50.*--lr-decay-iters 20",
        ),
        (
            ["--rampup-batch-size", "2", "2", "10"],
            1,
            "--rampup-batch-size needs --global-batch-size",
        ),
        (
            [
                "--rampup-batch-size",
                "3",
                "2",
                "10",
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "2",
            ],
            1,
            "START=3",
        ),
    ],
)
def test_inconsistent_settings_name_the_flags(argv, world, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_args(BASE + argv).validate(world)


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--fp16", "--bf16"], "--fp16 and --bf16"),
        (
            ["--use-distributed-optimizer", "--zero-stage", "3"],
            "--use-distributed-optimizer.*--zero-stage",
        ),
        (["--cpu-offload"], "--cpu-offload needs --zero-stage 3"),
        (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
        (
            ["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"],
            "--lr-warmup-iters and --lr-warmup-fraction",
        ),
        (["--release-fp32-grad"], "--release-fp32-grad"),
        (["--save-interval", "5"], "--save-interval needs --save"),
        (["--split", "a,b"], "--split"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
        (["--sequence-parallel"], "--sequence-parallel"),
        (["--hidden-dropout", "1"], r"--hidden-dropout must be in \[0, 1\)"),
        (["--attention-dropout", "-0.1"], r"--attention-dropout must be in \[0, 1\)"),
    ],
)
def test_bad_values_name_the_flag(argv, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_args(argv)


def test_dropout_flags_reach_the_model():
    from training.setup import build_model_config

    argv = ["--model", "tiny-llama", "--mock-data", "--hidden-dropout", "0.1"]
    config = build_model_config(parse_args([*argv, "--attention-dropout", "0.05"]))
    assert (config.hidden_dropout, config.attention_dropout) == (0.1, 0.05)
    assert build_model_config(parse_args(argv[:3])).hidden_dropout == 0.0


def test_missing_model_and_data():
    with pytest.raises(ValueError, match="--model NAME"):
        parse_args(["--mock-data"]).validate(1)
    with pytest.raises(ValueError, match="--data-path"):
        parse_args(["--model", "tiny-llama"]).validate(1)
    with pytest.raises(ValueError, match="--tokenizer-type"):
        parse_args(["--model", "tiny-llama", "--data-path", "x"]).validate(1)


def test_unknown_model_names_the_choices():
    from training.setup import build_model_config

    with pytest.raises(ValueError, match=r"--model 'llama-9000'.*tiny-llama"):
        build_model_config(parse_args(["--model", "llama-9000", "--mock-data"]))
    with pytest.raises(ValueError, match="--seq-length 4096"):
        build_model_config(parse_args(["--model", "tiny-llama", "--seq-length", "4096"]))


def test_defaults_global_batch_and_warmup_fraction():
    config = parse_args(
        [*BASE, "--micro-batch-size", "2", "--train-iters", "200", "--lr-warmup-fraction", "0.05"]
    )
    assert config.global_batch_size(world_size=4) == 8
    assert config.lr_decay_iters() == 200
    assert config.lr_warmup_iters() == 10
