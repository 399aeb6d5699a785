"""`--deepspeed-config`: every key of the DeepSpeed notes' example configurations is applied (its
effect visible in the resolved TrainConfig) or refused by name; none is dropped."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from services.trainer.arguments import parse_args
from services.trainer.cli import main as train_main
from services.trainer.train_config import SECTIONS, TrainConfig
from training import deepspeed_config

FIXTURES = Path(__file__).resolve().parent / "deepspeed"
EXAMPLES = sorted(p.name for p in FIXTURES.glob("*.json"))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--train-iters", "100"]  # fmt: skip


def _leaves(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{prefix}{k}.", v)]
    return [prefix.rstrip(".")]


def _resolved(config: TrainConfig, field: str) -> Any:
    for name in SECTIONS:
        if hasattr(getattr(config, name), field):
            return getattr(getattr(config, name), field)
    raise KeyError(field)


def _strip(ds: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """`ds` without the refused leaves (a refused `type` takes its whole block) and empty blocks."""
    out = copy.deepcopy(ds)
    for key in keys:
        parts = key.split(".")
        if parts[-1] == "type":
            parts = parts[:-1]
        node = out
        for part in parts[:-1]:
            node = node.get(part, {})
        node.pop(parts[-1], None)

    def prune(node: Any) -> Any:
        if isinstance(node, dict):
            kept = {k: prune(v) for k, v in node.items()}
            return {k: v for k, v in kept.items() if v != {}}
        return node

    return prune(out)


def test_the_notes_examples_are_all_here():
    # 001: ZeRO-1, ZeRO-2 and ZeRO-3 (+ CPU offload) for HF; 004: ZeRO-2 with optimizer offload,
    # ZeRO-3 with CPU offload, DeepSpeed-Chat's ZeRO-3; ZeRO-Infinity (NVMe) from DeepSpeed's
    # docs; an fp16 run with every loss-scale key, and a ZeRO-2 run with concrete values.
    assert EXAMPLES == [
        "fp16_loss_scale.json",
        "zero1.json",
        "zero2.json",
        "zero2_cpu_offload_optimizer.json",
        "zero3_cpu_offload.json",
        "zero3_deepspeed_chat.json",
        "zero3_nvme.json",
    ]


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_key_is_applied_or_refused_by_name(name, tmp_path):
    ds = json.loads((FIXTURES / name).read_text())
    mapping = deepspeed_config.map_config(ds, {})
    reported = {row.key for row in mapping.rows}
    missing = [leaf for leaf in _leaves("", ds) if leaf not in reported]
    assert not missing, f"{name}: keys dropped without a row: {missing}"
    refused = [row.key for row in mapping.refused()]
    path = FIXTURES / name
    if refused:
        with pytest.raises(ValueError) as caught:
            parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True)
        message = str(caught.value)
        assert f"{len(refused)} key(s) refused" in message
        for key in refused:
            assert key + ":" in message, (key, message)
    # What is not refused takes effect: the file without its refused keys resolves to a config
    # holding every mapped value, and differs from the same run without the file.
    kept = _strip(ds, refused)
    kept_path = tmp_path / name
    kept_path.write_text(json.dumps(kept))
    kept_map = deepspeed_config.map_config(kept, {})
    assert not kept_map.refused(), [r.key for r in kept_map.refused()]
    config = parse_args([*BASE, "--deepspeed_config", str(kept_path)], read_files=True)
    baseline = parse_args(BASE)
    applied = [row for row in kept_map.rows if row.status == "applied"]
    assert applied, name
    for row in applied:
        for field in row.fields:
            assert _resolved(config, field) == kept_map.fields[field], (row.key, field)
    changed = {
        f for r in applied for f in r.fields if _resolved(baseline, f) != _resolved(config, f)
    }
    assert changed, f"{name}: the mapped keys changed nothing"


def test_the_examples_effects_in_the_resolved_config(tmp_path):
    config = parse_args(
        [*BASE, "--deepspeed_config", str(FIXTURES / "zero2.json")], read_files=True
    )
    assert config.parallel.zero_stage == 2 and config.precision.bf16
    assert (config.batch.global_batch_size, config.batch.micro_batch_size) == (16, 2)
    assert (config.optim.optimizer, config.optim.lr, config.optim.weight_decay) == (
        "adamw",
        3e-4,
        0.1,
    )
    assert (config.optim.adam_beta1, config.optim.adam_beta2) == (0.9, 0.95)
    assert (config.optim.lr_decay_style, config.optim.lr_warmup_iters) == ("linear", 10)
    assert config.optim.lr_decay_iters == 100 and config.optim.min_lr == 0.0
    assert config.run.log_interval == 5 and config.run.log_dir == str(Path("runs") / "zero2")
    fp16 = parse_args([*BASE, "--deepspeed_config", str(FIXTURES / "fp16_loss_scale.json")],
                      read_files=True)  # fmt: skip
    p = fp16.precision
    assert p.fp16 and p.loss_scale is None and p.initial_loss_scale == 2.0**12
    assert (p.loss_scale_window, p.hysteresis, p.min_loss_scale) == (100, 3, 2.0)
    assert fp16.optim.lr_decay_style == "cosine" and fp16.optim.min_lr == pytest.approx(1e-4)
    assert fp16.optim.clip_grad == 0.5 and fp16.parallel.zero_stage == 1
    # ZeRO-3 with CPU offload, once its refused pin_memory keys say what Meshline does.
    ds = json.loads((FIXTURES / "zero3_cpu_offload.json").read_text())
    for block in ("offload_param", "offload_optimizer"):
        ds["zero_optimization"][block]["pin_memory"] = False
    ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(ds))
    z3 = parse_args([*BASE, "--lr", "1e-4", "--deepspeed_config", str(path)], read_files=True)
    assert z3.parallel.zero_stage == 3 and z3.parallel.cpu_offload
    assert z3.parallel.optimizer_cpu_offload and not z3.parallel.offload_pin_memory
    assert z3.optim.lr == 1e-4  # "auto": the flag decides
    assert z3.precision.initial_loss_scale == 2.0**16


def test_the_offload_ladder_keys_take_effect(tmp_path):
    """ZeRO-2 with optimizer offload (pinned) and the NVMe example's optimizer tier resolve to
    --optimizer-cpu-offload, --offload-pin-memory and --optimizer-nvme-path."""
    ds = json.loads((FIXTURES / "zero2_cpu_offload_optimizer.json").read_text())
    for key in ("allgather_bucket_size", "reduce_bucket_size"):  # refused: not about offload
        del ds["zero_optimization"][key]
    del ds["scheduler"]
    path = tmp_path / "z2_offload.json"
    path.write_text(json.dumps(ds))
    z2 = parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True).parallel
    assert (z2.zero_stage, z2.optimizer_cpu_offload, z2.offload_pin_memory) == (2, True, True)
    assert z2.optimizer_nvme_path is None and not z2.cpu_offload
    ds = json.loads((FIXTURES / "zero3_nvme.json").read_text())
    ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    path = tmp_path / "z3_nvme_optimizer.json"
    path.write_text(json.dumps(ds))
    z3 = parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True).parallel
    assert (z3.zero_stage, z3.cpu_offload, z3.optimizer_cpu_offload) == (3, True, True)
    assert z3.optimizer_nvme_path == "/local_nvme" and z3.offload_pin_memory


def test_zero_infinity_parameter_tier_keys_take_effect(tmp_path):
    """The NVMe example's offload_param (device nvme) resolves to --cpu-offload,
    --param-nvme-path and --param-nvme-buffer-count; without offload_optimizer the missing
    optimizer offload is named."""
    ds = json.loads((FIXTURES / "zero3_nvme.json").read_text())
    del ds["gradient_accumulation_steps"]  # refused: not about offload
    ds["zero_optimization"]["offload_param"]["buffer_count"] = 3
    path = tmp_path / "z3_nvme.json"
    path.write_text(json.dumps(ds))
    z3 = parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True).parallel
    assert (z3.zero_stage, z3.cpu_offload, z3.optimizer_cpu_offload) == (3, True, True)
    assert (z3.param_nvme_path, z3.param_nvme_buffer_count) == ("/local_nvme", 3)
    del ds["zero_optimization"]["offload_optimizer"]
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=r"--param-nvme-path .* add .*--optimizer-cpu-offload"):
        parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True)


@pytest.mark.parametrize(
    ("ds", "match"),
    [
        ({"zero_optimization": {"offload_param": {"device": "disk"}}},
         r"zero_optimization\.offload_param\.device: expected one of none, cpu, nvme"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, r"fp16\.hysteresis: expected a finite"),
        ({"fp16": {"enabled": "yes"}}, r"fp16\.enabled: expected true or false"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
         r"optimizer\.params\.betas: expected \[beta1, beta2\]"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"optimizer\.params\.lr"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
          "gradient_accumulation_steps": 1}, r"train_batch_size 10 must equal .* batch rule"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage: 0, 1, 2 or 3"),
        ({"steps_per_print": 0}, r"steps_per_print: expected a finite number >= 1"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
         r"scheduler\.params\.warmup_type: expected one of log, linear"),
    ],
)  # fmt: skip
def test_invalid_values_name_the_key_path(ds, match, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=match):
        parse_args([*BASE, "--deepspeed-config", str(path)], read_files=True)


@pytest.mark.parametrize(
    ("ds", "key", "use"),
    [
        ({"my_custom_key": 1}, "my_custom_key", "not a DeepSpeed configuration key"),
        ({"zero_optimization": {"stage": 2, "bogus": True}}, "zero_optimization.bogus", "remove"),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type", "AdamW"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}}},
         "optimizer.params.freeze_step", "AdamW"),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}, "scheduler.type",
         "--lr-decay-style"),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1}}},
         "scheduler.params.warmup_min_ratio", "set it to 0"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         "zero_optimization.offload_param.device", "needs ZeRO-3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         "zero_optimization.offload_optimizer.device", "needs nvme_path"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme",
                                                                  "nvme_path": "/n",
                                                                  "buffer_count": 8}}},
         "zero_optimization.offload_optimizer.buffer_count", "set 4"),
        ({"aio": {"queue_depth": 32}}, "aio.queue_depth", "pread/pwrite"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
         "zero_optimization.offload_param.device", "needs nvme_path"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}},
         "zero_optimization.reduce_bucket_size", "bucket sizes"),
        ({"activation_checkpointing": {"partition_activations": True}},
         "activation_checkpointing.partition_activations", "--sequence-parallel"),
        ({"wall_clock_breakdown": True}, "wall_clock_breakdown", "--profile"),
        ({"wandb": {"enabled": True, "project": "p"}}, "wandb.project", "--log-dir"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": True}},
         "fp16.consecutive_hysteresis", "drop the key"),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
         "optimizer.params.adam_w_mode", "decoupled"),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
         "gradient_accumulation_steps", "give train_batch_size"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_and_the_equivalent(ds, key, use, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError) as caught:
        parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True)
    message = str(caught.value)
    assert f"{key}: " in message and use in message.split(f"{key}: ", 1)[1], message


def test_disabled_feature_blocks_and_defaults_are_the_same(tmp_path):
    ds = {"wandb": {"enabled": False, "project": "p"}, "flops_profiler": {"enabled": False},
          "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8, "overlap_comm": True},
          "activation_checkpointing": {"partition_activations": False},
          "communication_data_type": "fp32", "gradient_accumulation_steps": 1}  # fmt: skip
    mapping = deepspeed_config.map_config(ds, {})
    assert not mapping.refused()
    assert {r.key for r in mapping.rows} >= set(_leaves("", ds))


def test_two_keys_setting_one_field_differently_name_both(tmp_path):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4,
                                                       "warmup_type": "linear"}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_max_lr means --lr 0\.0003 "
                       r"but optimizer\.params\.lr means --lr 0\.001"):  # fmt: skip
        deepspeed_config.map_config(ds, {})


def test_deepspeed_defaults_where_meshline_differs_and_key_order(tmp_path):
    # The scheduler before the optimizer: cos_min_ratio still scales the optimizer's lr.
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_type": "linear",
                                                             "cos_min_ratio": 0.5}},
          "optimizer": {"type": "SGD", "params": {"lr": 0.2}},
          "zero_optimization": {"mics_shard_size": -1}, "checkpoint": {"tag_validation": "WARN"},
          "fp16": {"enabled": True}}  # fmt: skip
    mapping = deepspeed_config.map_config(ds, {})
    assert not mapping.refused(), mapping.refused()
    f = mapping.fields
    assert f["min_lr"] == pytest.approx(0.1) and f["optimizer"] == "sgd"
    assert f["sgd_momentum"] == 0.0 and f["weight_decay"] == 0.0  # torch SGD's defaults
    assert f["initial_loss_scale"] == 2.0**16  # DeepSpeed's initial_scale_power 16
    # An explicit flag wins over DeepSpeed's default for an absent key.
    assert "sgd_momentum" not in deepspeed_config.map_config(ds, {"sgd_momentum": 0.9}).fields
    # WarmupDecayLR decays to 0: an explicit --min-lr that differs is a contradiction.
    decay = tmp_path / "decay.json"
    decay.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_type": "linear", "warmup_min_lr": 0, "total_num_steps": 50}}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"--min-lr 0\.0 but --min-lr 1e-05"):
        parse_args([*BASE, "--min-lr", "1e-5", "--deepspeed_config", str(decay)], read_files=True)


def test_a_mapped_key_contradicting_a_flag_names_both():
    with pytest.raises(
        ValueError, match=r"--deepspeed-config means --zero-stage 2 but --zero-stage 1"
    ):
        parse_args([*BASE, "--zero-stage", "1", "--deepspeed_config", str(FIXTURES / "zero2.json")],
                   read_files=True)  # fmt: skip


def test_the_batch_rule_is_checked_against_the_job(monkeypatch):
    argv = [*BASE, "--deepspeed_config", str(FIXTURES / "zero2.json")]
    monkeypatch.setenv("WORLD_SIZE", "4")  # a torchrun worker: 4 data-parallel ranks, rule needs 2
    with pytest.raises(ValueError, match=r"needs 2 data-parallel ranks, but this job has 4"):
        parse_args(argv, read_files=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(argv, read_files=True).batch.global_batch_size == 16


def test_hostile_files_are_refused_before_mapping(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"x": "' + "a" * (deepspeed_config.MAX_BYTES + 1) + '"}')
    deep = tmp_path / "deep.json"
    deep.write_text("{" + '"a": {' * 20 + "}" * 21)
    for path, match in ((big, "larger than"), (deep, "nested deeper")):
        with pytest.raises(ValueError, match=match):
            parse_args([*BASE, "--deepspeed-config", str(path)], read_files=True)


def test_dry_run_prints_the_mapping_table_with_resolved_values(capsys):
    argv = ["--dry-run", "--world-size", "2", *BASE, "--deepspeed_config",
            str(FIXTURES / "zero2.json")]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    ds = json.loads((FIXTURES / "zero2.json").read_text())
    for leaf in _leaves("", ds):
        assert f"\n{leaf} " in out, leaf
    assert "--zero-stage 2  [resolved: --zero-stage=2]" in out
    assert "ZeRO-2 bf16" in out  # the dry run's own layout line shows the mapped values
    # The same file on 4 ranks breaks DeepSpeed's batch rule (16 = 2 x 4 x dp needs dp 2).
    assert train_main([*argv[:2], "4", *argv[3:]]) == 2
    assert "needs 2 data-parallel ranks, but this job has 4" in capsys.readouterr().err


def test_dry_run_prints_the_table_of_a_refused_file(capsys, tmp_path):
    ds = json.loads((FIXTURES / "zero3_nvme.json").read_text())
    ds["zero_optimization"]["reduce_bucket_size"] = 2e8  # refused: not configurable
    path = tmp_path / "z3_nvme_refused.json"
    path.write_text(json.dumps(ds))
    argv = ["--dry-run", "--world-size", "2", *BASE, "--deepspeed-config", str(path)]
    assert train_main(argv) == 2
    captured = capsys.readouterr()
    assert "--param-nvme-path /local_nvme (the parameter shards' swap file)" in captured.out
    assert "zero_optimization.reduce_bucket_size" in captured.out
    assert "refused: bucket sizes are not configurable" in captured.out
    assert "key(s) refused" in captured.err


def test_the_autotuning_block_maps_onto_meshline_autotune(tmp_path):
    # DeepSpeed's autotuning tutorial block, with the values Meshline's autotuner implements.
    ds = {"train_micro_batch_size_per_gpu": "auto",
          "autotuning": {"enabled": True, "fast": True, "metric": "throughput",
                         "results_dir": str(tmp_path / "tuning"), "overwrite": True,
                         "start_profile_step": 2, "end_profile_step": 5,
                         "num_tuning_micro_batch_sizes": 2, "tuner_type": "gridsearch",
                         "tuner_early_stopping": 4, "tuner_num_trials": 9,
                         "min_train_micro_batch_size_per_gpu": 2,
                         "max_train_micro_batch_size_per_gpu": 16, "mp_size": 1,
                         "max_train_batch_size": None, "arg_mappings": None}}  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    config = parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True)
    section = config.autotune
    assert section.autotune and section.autotune_dir == str(tmp_path / "tuning")
    assert (section.autotune_warmup_steps, section.autotune_steps) == (2, 3)
    assert (section.autotune_min_micro_batch_size, section.autotune_max_micro_batch_size) == (2, 16)
    assert section.autotune_num_micro_batch_sizes == 2 and section.autotune_max_trials == 9
    assert section.autotune_early_stopping == 4
    mapping = deepspeed_config.map_config(ds, {})
    assert not mapping.refused() and {r.key for r in mapping.rows} >= set(_leaves("", ds))
    # Off (DeepSpeed's default when `enabled` is absent): every key is the same, nothing set.
    for block in ({"enabled": False, "tuner_type": "model_based"}, {"fast": False}):
        off = deepspeed_config.map_config({"autotuning": block}, {})
        assert not off.fields and {r.status for r in off.rows} == {"same"}
    for key, value, use in (("tuner_type", "model_based", "gridsearch"),
                            ("exps_dir", "exps", "results_dir"), ("fast", False, "set true"),
                            ("metric", "latency", "throughput")):  # fmt: skip
        refused = deepspeed_config.map_config({"autotuning": {"enabled": True, key: value}}, {})
        assert [r.key for r in refused.refused()] == [f"autotuning.{key}"]
        assert use in refused.refused()[0].setting
    with pytest.raises(ValueError, match=r"autotuning\.end_profile_step"):
        deepspeed_config.map_config(
            {"autotuning": {"enabled": True, "start_profile_step": 4, "end_profile_step": 4}}, {}
        )
