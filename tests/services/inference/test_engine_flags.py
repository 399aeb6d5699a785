"""Every engine setting of `serve inference` reaches the engine: flag -> config -> EngineConfig,
in one process and on every rank of a tensor/pipeline-parallel server (both call build_engine)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig
from services.inference import parallel_serving, serving
from services.inference.config import InferenceServiceConfig, add_flags, from_args

# A value other than the default for each EngineConfig field the server exposes.
NON_DEFAULT = {
    "max_batch_rows": ("--max-batch-rows", "3", 3),
    "max_model_len": ("--max-model-len", "64", 64),
    "kv_cache_memory": ("--kv-cache-memory", "1.5GiB", 3 * 2**29),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "0.5", 0.5),
    "dtype": ("--dtype", "bfloat16", "bfloat16"),
    "cpu_linear": ("--cpu-linear", "packed", "packed"),
    "compile_decode": ("--compile-decode", None, True),
    "decode_step": ("--decode-step", "module", "module"),
    "enforce_eager": ("--enforce-eager", None, True),
    "speculative_config": (
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
        SpeculativeConfig("ngram", 2, 5, 5),
    ),
    "enable_lora": ("--enable-lora", None, True),
    "max_loras": ("--max-loras", "3", 3),
    "max_lora_rank": ("--max-lora-rank", "64", 64),
    "block_size": ("--block-size", "32", 32),
    "enable_prefix_caching": ("--no-enable-prefix-caching", None, False),
    "enable_chunked_prefill": ("--enable-chunked-prefill", None, True),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "512", 512),
}
# Flags a case needs beside its own (a setting that only applies with another).
NEEDS = {"max_loras": ["--enable-lora"], "max_lora_rank": ["--enable-lora"]}


def test_every_served_engine_setting_has_a_case_here() -> None:
    served = {f.name for f in dataclasses.fields(InferenceServiceConfig)}
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert served & engine == set(NON_DEFAULT)


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_flag_reaches_the_engine_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, field: str
) -> None:
    flag, value, expected = NON_DEFAULT[field]
    parser = argparse.ArgumentParser()
    add_flags(parser)
    argv = ["--load", str(tmp_path), flag] + ([value] if value is not None else [])
    argv += NEEDS.get(field, [])
    config = from_args(parser.parse_args(argv))
    assert getattr(config, field) == expected
    assert getattr(from_args(parser.parse_args(["--load", str(tmp_path)])), field) != expected

    seen: list[EngineConfig] = []

    def build(spec, cfg, **kwargs):
        seen.append(cfg)
        return object(), object()

    monkeypatch.setattr(serving, "build_engine", build)
    monkeypatch.setattr(parallel_serving, "build_engine", build)
    monkeypatch.setattr(parallel_serving, "LeaderFollowerEngine", object)
    serving._load(config)
    parallel_serving.build_rank_engine(config)
    assert [getattr(cfg, field) for cfg in seen] == [expected, expected]


def test_size_suffixes_and_refusals(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)

    def parsed(*argv: str) -> InferenceServiceConfig:
        return from_args(parser.parse_args(["--load", str(tmp_path), *argv]))

    assert parsed("--kv-cache-memory", "512MiB").kv_cache_memory == 512 * 2**20
    assert parsed("--kv-cache-memory", "2GB").kv_cache_memory == 2 * 10**9
    assert parsed("--kv-cache-memory", "4096").kv_cache_memory == 4096
    with pytest.raises(ValueError, match="--kv-cache-memory '2 lots'"):
        parsed("--kv-cache-memory", "2 lots")
    with pytest.raises(ValueError, match="--max-model-len must be >= 2"):
        parsed("--max-model-len", "1")
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        parsed("--gpu-memory-utilization", "1.5")
    with pytest.raises(ValueError, match="not both"):
        parsed("--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB")
    with pytest.raises(ValueError, match="--enable-prefix-caching needs the paged KV cache"):
        parsed("--enable-prefix-caching", "--tensor-parallel-size", "2")
    # Speculation pages its rows (rejected drafts roll back in the block tables): accepted.
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert parsed("--block-size", "32", "--speculative-config", spec).block_size == 32
    # LoRA adapters page their rows (prefix-cache keys carry the adapter): accepted.
    both = parsed("--enable-chunked-prefill", "--enable-prefix-caching", "--enable-lora")
    assert both.enable_chunked_prefill and both.enable_prefix_caching and both.lora
    assert not parsed(
        "--no-enable-chunked-prefill", "--pipeline-parallel-size", "2"
    ).enable_chunked_prefill
    with pytest.raises(ValueError, match=r"--block-size must be in 1\.\.1024"):
        parsed("--block-size", "0")


def test_batch_wait_reaches_the_engine_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    config = from_args(parser.parse_args(["--load", str(tmp_path), "--batch-wait-ms", "2.5"]))
    assert from_args(parser.parse_args(["--load", str(tmp_path)])).batch_wait_ms == 1.0
    monkeypatch.setattr(serving, "_load", lambda config: (object(), object()))
    served = serving.build_serving_engine(config)
    try:
        assert served.worker is not None and served.worker.batch_wait_s == 0.0025
    finally:
        served.stop(5)


@pytest.mark.parametrize("value", [-1.0, 1001.0])
def test_batch_wait_out_of_range_names_the_flag(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match=r"--batch-wait-ms must be between 0 and 1000"):
        InferenceServiceConfig(load=tmp_path, batch_wait_ms=value)


def test_speculation_with_lora_adapters_reaches_the_engine(tmp_path: Path) -> None:
    """Drafts are verified with each row's adapter (tests/engine/test_multi_lora.py), so the
    two flags go together into the engine's config."""
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(
        ["--load", str(tmp_path), "--enable-lora", "--speculative-config", spec]
    )
    config = from_args(args)
    engine_config = config.engine_config()
    assert engine_config.enable_lora
    assert engine_config.speculative_config is not None
    assert engine_config.speculative_config.num_speculative_tokens == 2
