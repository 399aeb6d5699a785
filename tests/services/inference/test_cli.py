"""`meshline generate`: prompt / ids / --chat / --output-json on a saved checkpoint, errors as exit 2."""

from __future__ import annotations

import io
import json

import pytest

from engine.engine import Engine
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from services.inference.cli import main
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, sentencepiece_model):
    hf, ours, config = hf_reference("llama-gqa", seed=4, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    return directory, ours, config


def test_input_ids_to_json_match_the_engine(checkpoint, tmp_path):
    directory, ours, config = checkpoint
    out = tmp_path / "out.json"
    argv = ["--load", str(directory), "--input-ids", "1,40,77,9", "--num-beams", "3"]
    argv += ["--num-return-sequences", "2", "--max-new-tokens", "8", "--output-json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    engine = Engine(ours, TokenizerInfo(config.vocab_size, eos_id=2))
    cfg = SamplingConfig(max_new_tokens=8, num_beams=3, num_return_sequences=2)
    [expected] = engine.generate([[1, 40, 77, 9]], [cfg])
    assert [s["token_ids"] for s in payload["sequences"]] == [r.token_ids for r in expected]
    assert payload["prompt_token_ids"] == [1, 40, 77, 9]


def test_prompt_prints_text(checkpoint, capsys):
    directory, _, _ = checkpoint
    args = [
        "--load",
        str(directory),
        "--prompt",
        "The model",
        "--max-new-tokens",
        "6",
        "--do-sample",
    ]
    assert main([*args, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert main([*args, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_chat_session(checkpoint, capsys):
    directory, _, _ = checkpoint
    stdin = io.StringIO("hello there\nhow are you\nexit\n")
    argv = ["--load", str(directory), "--chat", "--max-new-tokens", "5", "--output-json", "-"]
    assert main(argv, stdin=stdin) == 0
    out = capsys.readouterr().out
    assert out.count("You >> ") == 3 and out.count("Meshline >> ") == 2
    transcript = json.loads(out[out.index("{") :])["chat"]
    assert [t["user"] for t in transcript] == ["hello there", "how are you"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--input-ids", "1,x"], "--input-ids"),
        (["--input-ids", "1,9999"], "--input-ids: token ids [9999]"),
        (["--input-ids", "1", "--temperature", "nan", "--do-sample"], "--temperature"),
        (["--input-ids", "1", "--max-new-tokens", "500"], "--max-new-tokens"),
        (["--prompt", "a", "--input-ids", "1"], "exactly one"),
    ],
)
def test_bad_input_exits_2(checkpoint, capsys, extra, message):
    directory, _, _ = checkpoint
    assert main(["--load", str(directory), *extra]) == 2
    assert message in capsys.readouterr().err
