"""`meshline preprocess merge` refuses shards that do not belong together (#37 finding 3).

Each case reproduces a merge that used to exit 0 and publish a dataset: shards computed over
different input states, a shard of another run, a missing shard next to an unsharded run. Now
merge fails naming the shard (`--input PREFIX`) and the provenance field, and the file that must
not appear (the merged manifest) does not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.preprocess.cli import main as cli_main
from services.preprocess.manifest import manifest_path, read_manifest
from services.preprocess.merge import merge_preprocessed
from services.preprocess.sharding import shard_prefixes
from tests.services.preprocess.test_sharded_preprocess import _run, sp_args, write_corpus


def _shards(corpus: Path, prefix: Path, model: str, *indices: int, extra: tuple = ()) -> list[str]:
    for index in indices:
        _run(corpus, prefix, sp_args(model), "--num-shards", "2", "--shard-index", str(index), *extra)  # fmt: skip
    return shard_prefixes(prefix, 2)


def _nothing_published(target: Path) -> None:
    assert not manifest_path(target).exists()
    assert not list(target.parent.glob(f"{target.name}_*"))


def test_every_manifest_records_its_provenance(tmp_path, sentencepiece_model):
    corpus = write_corpus(tmp_path, files=4)
    first, second = _shards(corpus, tmp_path / "s" / "c", sentencepiece_model, 0, 1)
    a, b = (read_manifest(manifest_path(p))["provenance"] for p in (first, second))
    for field in ("run_id", "input_fingerprint", "tokenizer_sha256", "handler_sha256"):
        assert a[field] == b[field] and len(a[field]) >= 16
    assert (a["shard_index"], b["shard_index"], a["num_shards"]) == (0, 1, 2)
    assert a["input_range"][1] == b["input_range"][0] and b["input_range"][1] == 4
    merged = read_manifest(manifest_path(merge_preprocessed([first, second], str(tmp_path / "m")).manifest_path[: -len(".manifest.json")]))  # fmt: skip
    assert [p["provenance"]["shard_index"] for p in merged["parts"]] == [0, 1]


def test_shards_over_different_input_states_are_refused(tmp_path, sentencepiece_model):
    corpus = write_corpus(tmp_path, files=4)
    prefix = tmp_path / "s" / "c"
    first, second = _shards(corpus, prefix, sentencepiece_model, 0)
    shutil.copy(corpus / "part-03.jsonl", corpus / "part-04.jsonl")  # a file added, listed twice
    _shards(corpus, prefix, sentencepiece_model, 1)
    target = tmp_path / "m"
    with pytest.raises(
        ValueError, match=rf"--input {second}: provenance field 'input_files_total'"
    ):
        merge_preprocessed([first, second], str(target))
    _nothing_published(target)
    # The same file count, one file rewritten between the two shards: the fingerprint differs.
    (corpus / "part-04.jsonl").unlink()
    _shards(corpus, prefix, sentencepiece_model, 1, extra=("--overwrite",))
    merge_preprocessed([first, second], str(target))  # back to the first state: it adds up
    (corpus / "part-00.jsonl").write_text((corpus / "part-00.jsonl").read_text() * 2)
    _shards(corpus, prefix, sentencepiece_model, 1, extra=("--overwrite",))
    with pytest.raises(
        ValueError, match=rf"--input {second}: provenance field 'input_bytes_total'"
    ):
        merge_preprocessed([first, second], str(tmp_path / "m2"))
    _nothing_published(tmp_path / "m2")


def test_a_shard_of_another_run_is_refused(tmp_path, sentencepiece_model):
    corpus = write_corpus(tmp_path, files=4)
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    (other / "part-01.jsonl").write_text((corpus / "part-02.jsonl").read_text())
    (other / "part-02.jsonl").write_text((corpus / "part-01.jsonl").read_text())
    prefix = tmp_path / "s" / "c"
    first, second = _shards(corpus, prefix, sentencepiece_model, 0)
    _shards(other, prefix, sentencepiece_model, 1)  # the same prefix, another run's input
    with pytest.raises(
        ValueError, match=rf"--input {second}: provenance field 'input_fingerprint'"
    ):
        merge_preprocessed([first, second], str(tmp_path / "m"))
    _nothing_published(tmp_path / "m")
    # A shard whose manifest was edited to claim a range it did not read.
    _shards(corpus, prefix, sentencepiece_model, 1, extra=("--overwrite",))
    document = read_manifest(manifest_path(second))
    document["provenance"]["input_range"] = [1, 4]
    manifest_path(second).write_text(json.dumps(document))
    with pytest.raises(ValueError, match=rf"--input {second}: provenance field 'input_range'"):
        merge_preprocessed([first, second], str(tmp_path / "m"))


def test_a_missing_shard_next_to_an_unsharded_run_is_refused(tmp_path, sentencepiece_model, capsys):
    corpus = write_corpus(tmp_path, files=4)
    whole = _run(corpus, tmp_path / "w" / "c", sp_args(sentencepiece_model))
    first, _ = _shards(corpus, tmp_path / "s" / "c", sentencepiece_model, 0)
    target = tmp_path / "m"
    argv = ["merge", "--input", whole, first, "--output-prefix", str(target)]
    assert cli_main(argv) == 1
    assert r"shard indices [0] are not 0..1 in order" in capsys.readouterr().err
    _nothing_published(target)
    assert cli_main(["merge", "--input", whole, whole, "--output-prefix", str(target)]) == 0
