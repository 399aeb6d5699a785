"""`make align` (services/demos/align.py) end to end, with fewer steps than the make target.

Every stage runs as a `meshline` subprocess: preprocess, train (sft, rm, grpo), convert, serve
inference, evaluate. The checks are on what the stages left behind, read from outside.
"""

from __future__ import annotations

import json

import pytest

from services.demos.align import main


@pytest.mark.slow
def test_make_align_runs_every_stage_and_scores_the_served_policy(tmp_path, capsys):
    run = tmp_path / "align"
    argv = ["--run-dir", str(run), "--numbers", "8", "--sft-iters", "4", "--rm-iters", "4"]
    assert main([*argv, "--grpo-iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "make align: done" in out and "GRPO reward" in out and "gsm8k exact" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rm"]["step"] == 4 and 0.0 <= summary["rm"]["accuracy"] <= 1.0
    first, last = summary["grpo_first"], summary["grpo_last"]
    assert (first["step"], last["step"]) == (1, 2)
    assert {"reward", "reward_std", "kl", "rollout_tokens_per_s"} <= set(first)
    assert summary["reward_start"] == {"reward": first["reward"], "steps": [1, 1]}
    assert summary["reward_end"] == {"reward": last["reward"], "steps": [2, 2]}
    for name in ("sft", "grpo"):
        assert 0.0 <= summary["exact_match"][name] <= 1.0
        # The HF export carries the tokenizer the checkpoint was trained with (served from it).
        hf = run / f"hf-{name}"
        assert (hf / "tokenizer.json").is_file() and (hf / "model.safetensors").is_file()
        assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    results = json.loads((run / "eval-grpo" / "results.json").read_text())
    assert results["n-samples"]["gsm8k"]["effective"] == 8  # every prompt reached the server
    assert (run / "grpo" / "latest").is_file() and (run / "rm" / "latest").is_file()


@pytest.mark.parametrize("flag", ["--numbers", "--sft-iters", "--rm-iters", "--grpo-iters"])
def test_non_positive_sizes_are_refused_by_name_before_any_stage(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        main(["--run-dir", str(tmp_path / "align"), flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "align").exists()
