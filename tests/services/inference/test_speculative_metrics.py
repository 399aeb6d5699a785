"""`--speculative-config` on the inference service: refused by name before any weight is read,
and a speculative engine's drafted/accepted counts reach /metrics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from services.inference import metrics
from services.inference.config import InferenceServiceConfig, add_flags, from_args
from tests.services.inference.helpers import hf_reference, prompt


def _parse(argv: list[str]) -> InferenceServiceConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_args(parser.parse_args(argv))


def test_flag_is_validated_before_loading(tmp_path: Path) -> None:
    # tmp_path holds no checkpoint: the flag's errors come first, from the config alone.
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match=r"--speculative-config: unknown key\(s\) \['lookahead'\]"):
        _parse(["--load", str(tmp_path), "--speculative-config", bad])
    good = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--speculative-config serves from one process"):
        _parse(
            ["--load", str(tmp_path), "--speculative-config", good, "--tensor-parallel-size", "2"]
        )
    missing = json.dumps({"model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"'model' .* is not an existing checkpoint directory"):
        _parse(["--load", str(tmp_path), "--speculative-config", missing])
    config = _parse(["--load", str(tmp_path), "--speculative-config", good])
    assert config.engine_config().speculative_config == config.speculative_config


def _sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    return 0.0 if value is None else value


def test_metrics_count_drafts_and_acceptances() -> None:
    _, ours, _ = hf_reference("llama-gqa", seed=3, vocab_size=16)
    spec = _parse(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
        ]
    ).speculative_config
    engine = Engine(
        ours,
        TokenizerInfo(16),
        EngineConfig(max_batch_rows=4, cpu_linear="dense", speculative_config=spec),
    )
    names = [
        "meshline_inference_spec_decode_drafts_total",
        "meshline_inference_spec_decode_draft_tokens_total",
        "meshline_inference_spec_decode_accepted_tokens_total",
    ]
    before = [_sample(n) for n in names]
    metrics.instrument(engine)
    engine.generate([prompt(6, 16, seed=4)], [SamplingConfig(max_new_tokens=50)])
    moved = [_sample(n) - b for n, b in zip(names, before, strict=True)]
    stats = engine.speculation.stats
    assert moved == [stats.verifications, stats.drafted, stats.accepted]
    assert 0 < stats.accepted < stats.drafted
    rate = _sample("meshline_inference_spec_decode_acceptance_rate")
    assert rate == pytest.approx(stats.accepted / stats.drafted)
