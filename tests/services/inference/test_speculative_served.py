"""`meshline serve inference --speculative-config ...` as a user starts it: greedy tokens over
gRPC equal HF `generate`, a sampled request is served, and /metrics counts the drafts."""

from __future__ import annotations

import json
import signal
import sys

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.served_process import GRPC_PORT, METRICS_PORT, launched
from tests.services.inference.helpers import hf_generate, prompt
from tests.services.inference.http_served import make_checkpoint

PATTERNS = {"grpc": GRPC_PORT, "metrics": METRICS_PORT}


@pytest.mark.slow
def test_speculative_server_matches_hf_and_reports_drafts(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=5)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(directory), "--metrics-port", "0", "--grace-period", "5"]
    command += ["--speculative-config", json.dumps(spec)]
    with launched(command, PATTERNS, ready_s=180) as server:
        ports = server.ports
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
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, server.tail()
