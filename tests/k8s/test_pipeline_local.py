"""The rendered pipeline, run on this machine the way a kubelet would run its containers: every
stage's init and main container command from `kubectl kustomize k8s/pipeline`, with the
ConfigMap's environment and `$(VAR)` expansion, the shared volume as a directory, and the train
Job's two pods as two torchrun agents meeting at a c10d rendezvous on localhost. Proves the
commands and flags in the manifests work together: demo data -> shards -> 2-node training ->
HF checkpoint (logit parity verified by the converter) -> BoolQ results."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.k8s.helpers import K8S, ROOT, container_env, expand, render

STAGES = (
    "meshline-pipeline-preprocess",
    "meshline-pipeline-preprocess-merge",
    "meshline-train",
    "meshline-pipeline-convert",
    "meshline-pipeline-evaluate",
)
# Smaller than the manifests' settings so the run fits the test budget; flags the stages keep.
OVERRIDES = {"MESHLINE_DEMO_CORPUS_MB": "1", "MESHLINE_EVAL_LIMIT": "8"}
TRAIN_OVERRIDES = ["--train-iters", "4", "--split", "80,20,0", "--lr-warmup-iters", "1", "--eval-interval", "4", "--eval-iters", "1", "--log-interval", "2"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalKubelet:
    """Runs pod containers as local processes: volume mounts become directories."""

    def __init__(self, volume: Path, config: dict[str, str], rendezvous: str) -> None:
        self.mounts = {
            "/opt/meshline/pipeline": str(K8S / "pipeline" / "scripts"),
            "/data": str(volume),
        }
        self.config = config
        self.rendezvous = rendezvous
        self.log = volume.parent / "pipeline.log"

    def _path(self, value: str) -> str:
        for mount, directory in self.mounts.items():
            value = value.replace(mount, directory)
        return value

    def start(self, container: dict, extra: dict[str, str]) -> subprocess.Popen:
        """Starts one container's command; returns its process."""
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp",
               "PYTHONPATH": str(ROOT), "STAGE_POLL_SECONDS": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
        env.update({k: self._path(v) for k, v in self.config.items()})
        env.update(extra)
        env = {k: self._path(v) for k, v in container_env(container, env).items()}
        args = [self._path(expand(a, env)) for a in container["args"]]
        # The pod-0 DNS name exists only in a cluster; here both agents meet on localhost.
        args = [a.replace(env.get("RDZV_ENDPOINT", "\0"), self.rendezvous) for a in args]
        if "services.trainer.train" in args:
            args += TRAIN_OVERRIDES
        with self.log.open("a") as log:
            return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.dist
def test_rendered_pipeline_runs_end_to_end(tmp_path):
    objects = render("pipeline")
    config = next(o for o in objects if o["kind"] == "ConfigMap" and "PIPELINE_DIR" in o["data"])
    volume = tmp_path / "volume"
    boolq = volume / "tasks" / "boolq"
    boolq.mkdir(parents=True)
    with (boolq / "dev.jsonl").open("w") as f:
        for i in range(8):
            parity = "even" if i % 2 == 0 else "odd"
            record = {
                "question": f"is {i} even",
                "passage": f"{i} is {parity}.",
                "answer": i % 2 == 0,
            }
            f.write(json.dumps(record) + "\n")
    kubelet = LocalKubelet(volume, {**config["data"], **OVERRIDES}, f"localhost:{_free_port()}")
    jobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}
    for name in STAGES:
        spec = jobs[name]["spec"]["template"]["spec"]
        for init in spec.get("initContainers", []):
            assert kubelet.start(init, {}).wait(timeout=60) == 0, kubelet.log.read_text()[-3000:]
        (main,) = spec["containers"]
        pods = jobs[name]["spec"].get("completions", 1)
        env = {"POD_NAMESPACE": "meshline"}
        procs = [kubelet.start(main, {**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(pods)]
        codes = [p.wait(timeout=600) for p in procs]
        assert codes == [0] * pods, f"{name}: {codes}\n{kubelet.log.read_text()[-3000:]}"
    run = volume / "pipeline" / "demo"
    assert sorted(p.name for p in (run / "stages").iterdir()) == [
        "convert.done", "corpus.done", "evaluate.done", "preprocess-part-0.done",
        "preprocess-part-1.done", "preprocess-part-2.done", "preprocess.done", "train.done"
    ]  # fmt: skip
    merged = json.loads((run / "shards" / "corpus.manifest.json").read_text())
    assert [part["shard"]["index"] for part in merged["parts"]] == [0, 1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "4"
    assert (run / "hf" / "config.json").is_file()
    results = json.loads((run / "eval" / "results.json").read_text())
    assert "boolq" in json.dumps(results)
    log = kubelet.log.read_text()
    assert "max |logit difference|" in log and "(passed)" in log
    assert log.count("MESHLINE_METRICS ") >= 2, "rank 0 prints metrics for the launcher"


@pytest.mark.slow
def test_rendered_preprocess_shards_on_three_pods_then_merges_to_one_process(tmp_path):
    """The preprocess Indexed Job's pods (all at once, as the Job runs them) and the merge Job,
    from the rendered manifests: the merged shard equals one `meshline preprocess` over the corpus."""
    objects = render("pipeline")
    config = next(o for o in objects if o["kind"] == "ConfigMap" and "PIPELINE_DIR" in o["data"])
    volume = tmp_path / "volume"
    overrides = {"MESHLINE_DEMO_CORPUS_MB": "0.3", "MESHLINE_PREPROCESS_WORKERS": "1"}
    kubelet = LocalKubelet(volume, {**config["data"], **overrides}, "localhost:1")
    jobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}
    for name in STAGES[:2]:
        spec = jobs[name]["spec"]["template"]["spec"]
        (main,) = spec["containers"]
        pods = jobs[name]["spec"].get("completions", 1)
        for init in spec.get("initContainers", []):
            assert kubelet.start(init, {}).wait(timeout=60) == 0, kubelet.log.read_text()[-3000:]
        procs = [kubelet.start(main, {"JOB_COMPLETION_INDEX": str(i)}) for i in range(pods)]
        codes = [p.wait(timeout=300) for p in procs]
        assert codes == [0] * pods, f"{name}: {codes}\n{kubelet.log.read_text()[-3000:]}"
    corpus = volume / "corpus" / "stdlib" / "corpus"
    assert len(list(corpus.glob("part-*.jsonl"))) == int(
        config["data"]["MESHLINE_DEMO_CORPUS_PARTS"]
    )
    single = tmp_path / "single" / "corpus"
    subprocess.run(
        [sys.executable, "-m", "services.cli", "preprocess", "--input", str(corpus),
         "--tokenizer-type", "SentencePiece", "--append-eod", "--output-prefix", str(single),
         "--tokenizer-model", str(volume / "corpus" / "stdlib" / "tokenizer.model")],
        check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
    )  # fmt: skip
    merged = volume / "pipeline" / "demo" / "shards" / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        assert Path(f"{merged}{suffix}").read_bytes() == Path(f"{single}_text_document{suffix}").read_bytes()  # fmt: skip
    manifest = json.loads((merged.parent / "corpus.manifest.json").read_text())
    assert len(manifest["parts"]) == int(config["data"]["MESHLINE_PREPROCESS_SHARDS"])
