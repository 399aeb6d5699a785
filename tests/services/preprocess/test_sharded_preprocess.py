"""Preprocessing across many pods: `--num-shards/--shard-index` (or `JOB_COMPLETION_INDEX`) on
3 processes, then `meshline preprocess merge`, gives `.bin/.idx` byte-identical to one process
over the same inputs, with a manifest listing every part; bad shards and mismatched parts fail
with errors naming the flag or the input."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.preprocess.cli import main
from services.preprocess.manifest import file_entry, manifest_path, read_manifest
from services.preprocess.merge import merge_preprocessed
from services.preprocess.sharding import (
    default_shard_index,
    shard_prefix,
    shard_prefixes,
    split_ranges,
)
from tests.fixtures import records as fx
from tokendata.indexed import IndexedDataset, IndexedDatasetWriter, bin_path, idx_path

REPO = Path(__file__).resolve().parents[3]
SHARDS = 3


def sp_args(model) -> list[str]:
    return ["--tokenizer-type", "SentencePiece", "--tokenizer-model", str(model), "--append-eod"]


def write_corpus(root: Path, files: int = 7) -> Path:
    """`files` JSONL files of different sizes (2..14 records), names sorted = reading order."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(files):
        lines = [
            {"text": f"{fx.PLAIN[(i + j) % len(fx.PLAIN)]} file {i} line {j}."}
            for j in range(2 + (i * 5) % 13)
        ]
        fx.write_jsonl(corpus / f"part-{i:02d}.jsonl", lines)
    return corpus


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`meshline preprocess ...` as its own process (a "pod")."""
    full_env = {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}
    full_env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "preprocess", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_split_is_contiguous_balanced_and_never_empty():
    sizes = [100, 5, 5, 5, 300, 10, 90, 1, 1, 200]
    for shards in range(1, len(sizes) + 1):
        ranges = split_ranges(sizes, shards)
        assert ranges == split_ranges(list(sizes), shards), "deterministic"
        assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), "contiguous"
        assert all(stop > start for start, stop in ranges), "no empty shard"
    # By bytes, not by file count: the 300-byte file and its neighbours split the total evenly.
    ranges = split_ranges(sizes, 2)
    halves = [sum(sizes[a:b]) for a, b in ranges]
    assert abs(halves[0] - halves[1]) <= max(sizes), halves
    assert split_ranges([0, 0, 0, 0], 2) == [(0, 2), (2, 4)], "empty files split by count"
    with pytest.raises(ValueError, match=r"--num-shards 4: only 3 input file"):
        split_ranges([1, 2, 3], 4)


def test_shard_index_comes_from_the_flag_then_job_completion_index():
    assert default_shard_index(2, 3, {"JOB_COMPLETION_INDEX": "0"}) == 2
    assert default_shard_index(None, 3, {"JOB_COMPLETION_INDEX": "1"}) == 1
    assert default_shard_index(None, 1, {}) == 0
    with pytest.raises(ValueError, match=r"--shard-index: missing for --num-shards 3"):
        default_shard_index(None, 3, {})
    with pytest.raises(ValueError, match=r"JOB_COMPLETION_INDEX='x' is not an integer"):
        default_shard_index(None, 3, {"JOB_COMPLETION_INDEX": "x"})
    assert shard_prefix("out/c", 1, 3) == "out/c-shard-00001-of-00003"
    assert shard_prefix("out/c", 0, 1) == "out/c"
    assert shard_prefixes("c", 2) == ["c-shard-00000-of-00002", "c-shard-00001-of-00002"]


def test_three_pods_then_merge_equal_one_process(tmp_path, sentencepiece_model):
    corpus = write_corpus(tmp_path)
    single = tmp_path / "single" / "corpus"
    sharded = tmp_path / "sharded" / "corpus"
    common = ["--input", str(corpus), *sp_args(sentencepiece_model)]
    # Three "pods": the same command line, the shard index from JOB_COMPLETION_INDEX (two of
    # them) or --shard-index (the third), all running at once beside the single-process run.
    pods = [
        cli(*common, "--output-prefix", str(sharded), "--num-shards", "3",
            env={"JOB_COMPLETION_INDEX": str(i)})
        for i in (0, 1)
    ]  # fmt: skip
    pods.append(
        cli(*common, "--output-prefix", str(sharded), "--num-shards", "3", "--shard-index", "2")
    )
    reference = cli(*common, "--output-prefix", str(single))
    for proc in [*pods, reference]:
        finish(proc)
    parts = shard_prefixes(sharded, SHARDS)
    part_inputs = []
    for index, part in enumerate(parts):
        manifest = read_manifest(manifest_path(part))
        assert manifest["shard"]["index"] == index and manifest["shard"]["num_shards"] == SHARDS
        assert manifest["shard"]["input_files_total"] == 7
        part_inputs.append([Path(e["path"]).name for e in manifest["inputs"]])
    assert all(part_inputs), "every pod got at least one file"
    assert [name for part in part_inputs for name in part] == sorted(
        p.name for p in corpus.iterdir()
    ), "contiguous, sorted"

    out = finish(cli("merge", "--output-prefix", str(sharded), "--num-shards", "3"))
    assert "merged 3 parts" in out
    merged_ds = f"{sharded}_text_document"
    single_ds = f"{single}_text_document"
    assert bin_path(merged_ds).read_bytes() == bin_path(single_ds).read_bytes()
    assert idx_path(merged_ds).read_bytes() == idx_path(single_ds).read_bytes()

    merged = read_manifest(manifest_path(sharded))
    one = read_manifest(manifest_path(single))
    assert [p["shard"]["index"] for p in merged["parts"]] == [0, 1, 2]
    assert [p["prefix"] for p in merged["parts"]] == parts
    assert [[Path(e["path"]).name for e in p["inputs"]] for p in merged["parts"]] == part_inputs
    assert merged["inputs"] == one["inputs"], "every input, with size and sha256, in order"
    for part in merged["parts"]:
        assert part["manifest"] == file_entry(manifest_path(part["prefix"]))
        (entry,) = part["outputs"]
        for f in entry["files"]:
            assert file_entry(Path(part["prefix"]).parent / f["name"]) == f
    for key in ("documents", "tokens", "records"):
        assert merged["counts"][key] == one["counts"][key]
    (dataset,) = merged["outputs"]
    assert dataset["files"] == [file_entry(bin_path(merged_ds)), file_entry(idx_path(merged_ds))]
    assert dataset["documents"] == one["outputs"][0]["documents"]
    assert dataset["dtype"] == "uint16" and merged["tokenizer"] == one["tokenizer"]

    ours = IndexedDataset(merged_ds)
    megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    theirs = megatron_indexed.IndexedDataset(merged_ds)
    assert len(theirs) == len(ours) and ours.num_documents == one["counts"]["documents"]
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])


def test_bad_shard_settings_fail_naming_the_flag(tmp_path, sentencepiece_model, capsys):
    corpus = write_corpus(tmp_path, files=3)
    base = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o" / "c")]
    base += sp_args(sentencepiece_model)
    assert main([*base, "--num-shards", "3", "--shard-index", "3"]) == 1
    assert "--shard-index 3 is out of range for --num-shards 3" in capsys.readouterr().err
    assert main([*base, "--num-shards", "0", "--shard-index", "0"]) == 1
    assert "--num-shards: must be >= 1" in capsys.readouterr().err
    assert main([*base, "--num-shards", "4", "--shard-index", "0"]) == 1
    assert "--num-shards 4: only 3 input file(s)" in capsys.readouterr().err
    os.environ.pop("JOB_COMPLETION_INDEX", None)
    assert main([*base, "--num-shards", "2"]) == 1
    assert "--shard-index: missing for --num-shards 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_job_completion_index_out_of_range_fails(
    tmp_path, sentencepiece_model, monkeypatch, capsys
):
    corpus = write_corpus(tmp_path, files=3)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "5")
    code = main(["--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
                 "--num-shards", "3", *sp_args(sentencepiece_model)])  # fmt: skip
    assert code == 1
    assert "--shard-index 5 is out of range for --num-shards 3" in capsys.readouterr().err


def _run(corpus: Path, prefix: Path, tokenizer: list[str], *extra: str) -> str:
    assert main(["--input", str(corpus), "--output-prefix", str(prefix), *tokenizer, *extra]) == 0
    return str(prefix)


def test_merge_refuses_mismatched_tokenizers(tmp_path, sentencepiece_model, hf_tokenizer_dir):
    corpus = write_corpus(tmp_path, files=2)
    a = _run(corpus, tmp_path / "a", sp_args(sentencepiece_model))
    b = _run(corpus, tmp_path / "b", ["--tokenizer-name-or-path", str(hf_tokenizer_dir)])
    with pytest.raises(ValueError, match=rf"--input {b}: tokenizer differs from --input {a}"):
        merge_preprocessed([a, b], str(tmp_path / "ab"))
    assert not list(tmp_path.glob("ab*")), "nothing published"
    # The same tokenizer file elsewhere (another node's mount) is the same tokenizer ...
    moved = tmp_path / "elsewhere" / "sp.model"
    moved.parent.mkdir()
    moved.write_bytes(Path(sentencepiece_model).read_bytes())
    c = _run(corpus, tmp_path / "c", sp_args(moved))
    merge_preprocessed([a, c], str(tmp_path / "ac"))
    # ... and a merged dataset merges again; but other token flags (no --append-eod) do not mix.
    merge_preprocessed([str(tmp_path / "ac"), a], str(tmp_path / "aca"))
    d = _run(corpus, tmp_path / "d", sp_args(sentencepiece_model)[:-1])
    with pytest.raises(ValueError, match=rf"--input {d}: token flags .* differ from --input {a}"):
        merge_preprocessed([a, d], str(tmp_path / "ad"))


def test_merge_refuses_mismatched_dtypes(tmp_path, sentencepiece_model):
    corpus = write_corpus(tmp_path, files=2)
    a = _run(corpus, tmp_path / "a", sp_args(sentencepiece_model))
    # Part b: the same tokenizer record but its tokens stored as int32 (e.g. another tool's run).
    b = tmp_path / "b"
    manifest = read_manifest(manifest_path(a))
    source = IndexedDataset(f"{a}_text_document")
    with IndexedDatasetWriter(f"{b}_text_document", np.int32) as writer:
        for doc in range(source.num_documents):
            writer.add_document(source.document(doc))
    out = manifest["outputs"][0]
    out["dtype"] = "int32"
    out["files"] = [file_entry(bin_path(f"{b}_text_document")), file_entry(idx_path(f"{b}_text_document"))]  # fmt: skip
    manifest_path(b).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"--input {b}: dataset 'text' has dtype int32"):
        merge_preprocessed([a, str(b)], str(tmp_path / "ab"))
    # The writer refuses too, naming the part, should a manifest not tell.
    with IndexedDatasetWriter(tmp_path / "w", np.uint16) as writer:
        with pytest.raises(ValueError, match=r"cannot merge .*b_text_document.*dtype int32"):
            writer.add_index(f"{b}_text_document")
        writer.abort()


def test_merge_refuses_missing_changed_or_reordered_parts(tmp_path, sentencepiece_model, capsys):
    corpus = write_corpus(tmp_path, files=4)
    prefix = tmp_path / "s" / "c"
    for i in range(2):
        _run(corpus, prefix, sp_args(sentencepiece_model), "--num-shards", "2", "--shard-index", str(i))  # fmt: skip
    first, second = shard_prefixes(prefix, 2)
    with pytest.raises(ValueError, match=r"shard indices \[1, 0\] are not 0..1 in order"):
        merge_preprocessed([second, first], str(tmp_path / "m"))
    missing = str(tmp_path / "nope")
    assert main(["merge", "--input", first, missing, "--output-prefix", str(tmp_path / "m")]) == 1
    assert f"--input {missing}: no manifest nope.manifest.json" in capsys.readouterr().err
    assert main(["merge", "--output-prefix", str(prefix)]) == 1
    assert "either --input PREFIX... or --num-shards N" in capsys.readouterr().err
    data = bin_path(f"{second}_text_document")
    data.write_bytes(data.read_bytes()[:-2] + b"\x01\x00")
    with pytest.raises(ValueError, match=rf"--input {second}: .*sha256 in its manifest"):
        merge_preprocessed([first, second], str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"shard indices \[0\] are not 0..1 in order"):
        merge_preprocessed([first], str(tmp_path / "m"))  # a shard missing
    # Unsharded runs merge in the order given; a second merge needs --overwrite.
    whole = _run(corpus, tmp_path / "w" / "c", sp_args(sentencepiece_model))
    merge_preprocessed([whole, whole], str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"outputs already exist"):
        merge_preprocessed([whole], str(tmp_path / "m"))
    result = merge_preprocessed([whole], str(tmp_path / "m"), overwrite=True)
    assert result.parts == 1
    assert (
        bin_path(f"{whole}_text_document").read_bytes()
        == Path(result.outputs[0].files[0]).read_bytes()
    )


def test_grpc_requests_carry_the_shard_and_are_validated(tmp_path, sentencepiece_model):
    import shutil

    import grpc

    from meshline.common.v1 import operations_pb2
    from tests.services.preprocess.test_servicer import _request, _run

    corpus = write_corpus(tmp_path, files=4)
    model = Path(shutil.copy(sentencepiece_model, tmp_path / "sp.model"))
    prefix = tmp_path / "out" / "c"
    prefix.parent.mkdir()
    inputs = [str(corpus)]
    requests = [
        *(_request(model, prefix, input=inputs, num_shards=2, shard_index=i) for i in range(2)),
        _request(model, tmp_path / "one", input=inputs),
        _request(model, prefix, input=inputs, num_shards=2, shard_index=2),
        _request(model, prefix, input=inputs, num_shards=2),
        _request(model, prefix, input=inputs, num_shards=0, shard_index=0),
    ]
    outcomes = _run(tmp_path, requests)
    for done in outcomes[:3]:
        assert isinstance(done, operations_pb2.Operation) and done.done, done
        assert not done.HasField("error"), done.error
    for error, field in zip(
        outcomes[3:], ("shard_index", "shard_index", "num_shards"), strict=True
    ):
        assert isinstance(error, grpc.aio.AioRpcError), error
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in error.details(), error.details()
    assert "out of range for num_shards 2" in outcomes[3].details()
    merge_preprocessed(shard_prefixes(prefix, 2), str(prefix))
    for suffix in (".bin", ".idx"):
        merged = Path(f"{prefix}_text_document{suffix}").read_bytes()
        assert merged == Path(f"{tmp_path / 'one'}_text_document{suffix}").read_bytes()


def test_a_shard_of_only_empty_files_writes_an_empty_dataset(tmp_path, sentencepiece_model):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "00-empty.jsonl").write_text("")
    fx.write_jsonl(corpus / "01.jsonl", [{"text": f"{fx.PLAIN[i % 5]} {i}"} for i in range(60)])
    fx.write_jsonl(corpus / "02.jsonl", [{"text": fx.PLAIN[0]}])
    fx.write_jsonl(corpus / "03.jsonl", [{"text": fx.PLAIN[1]}])
    prefix, single = tmp_path / "s" / "c", tmp_path / "one" / "c"
    for i in range(3):
        _run(corpus, prefix, sp_args(sentencepiece_model), "--num-shards", "3", "--shard-index", str(i))  # fmt: skip
    first = read_manifest(manifest_path(shard_prefixes(prefix, 3)[0]))
    assert [Path(e["path"]).name for e in first["inputs"]] == ["00-empty.jsonl"]
    assert first["counts"]["documents"] == 0 and first["outputs"][0]["documents"] == 0
    assert len(IndexedDataset(f"{shard_prefixes(prefix, 3)[0]}_text_document")) == 0
    merge_preprocessed(shard_prefixes(prefix, 3), str(prefix))
    _run(corpus, single, sp_args(sentencepiece_model))
    for suffix in (".bin", ".idx"):
        merged = Path(f"{prefix}_text_document{suffix}").read_bytes()
        assert merged == Path(f"{single}_text_document{suffix}").read_bytes()
    # Unsharded, an empty input is still an error.
    assert main(["--input", str(corpus / "00-empty.jsonl"), "--output-prefix", str(tmp_path / "e"),
                 *sp_args(sentencepiece_model)]) == 1  # fmt: skip
