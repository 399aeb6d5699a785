"""`meshline serve inference --speculative-config ...` as a user starts it: greedy tokens over
gRPC equal HF `generate`, a sampled request is served, and /metrics counts the drafts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.services.inference.helpers import hf_generate, prompt
from tests.services.inference.http_served import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]
PATTERNS = {
    "grpc": re.compile(r"serving \S+ on 127\.0\.0\.1:(\d+)"),
    "metrics": re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics"),
}


@pytest.mark.slow
def test_speculative_server_matches_hf_and_reports_drafts(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=5)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(directory), "--metrics-port", "0", "--grace-period", "5"]
    command += ["--speculative-config", json.dumps(spec)]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    ports: dict[str, int] = {}
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            for name, pattern in PATTERNS.items():
                if (match := pattern.search(line)) and name not in ports:
                    ports[name] = int(match[1])
            if len(ports) == len(PATTERNS):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180) and len(ports) == 2, "".join(lines[-30:])
        stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
        base = prompt(6, config.vocab_size, seed=4)
        ids = base + base[:3] + base  # repeated n-grams: lookups find drafts
        reply = stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=ids, params=pb.SamplingParams(max_new_tokens=24, do_sample=False)
            ),
            timeout=120,
        )
        expected = hf_generate(hf, ids, max_new_tokens=24)[0, len(ids) :].tolist()
        assert list(reply.sequences[0].token_ids) == expected
        sampled = stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=ids,
                params=pb.SamplingParams(max_new_tokens=8, do_sample=True, top_k=5, seed=3),
            ),
            timeout=120,
        )
        assert len(sampled.sequences[0].token_ids) == 8
        text = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["meshline_inference_spec_decode_drafts_total"] > 0
        assert (
            values["meshline_inference_spec_decode_draft_tokens_total"]
            >= (values["meshline_inference_spec_decode_accepted_tokens_total"])
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, "".join(lines[-30:])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
