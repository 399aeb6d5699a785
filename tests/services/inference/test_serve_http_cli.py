"""`meshline serve inference --load DIR --http-port 0 --metrics-port 0` as a user starts it.

One process: gRPC, the OpenAI HTTP API and /metrics on three ports, one engine; SIGTERM stops
all of them and the process exits 0.
"""

from __future__ import annotations

import signal
import sys

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.served_process import GRPC_PORT, HTTP_PORT, METRICS_PORT, launched
from tests.services.inference.http_served import make_checkpoint

openai = pytest.importorskip("openai")
PATTERNS = {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}


def test_one_process_serves_grpc_http_and_metrics(tmp_path_factory, sentencepiece_model):
    directory, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=7)
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(directory), "--http-port", "0", "--metrics-port", "0"]
    command += ["--chat-template", "chatml", "--served-model-name", "tiny", "--grace-period", "5"]
    with launched(command, PATTERNS, ready_s=120) as server:
        ports = server.ports
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        text = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"meshline_http_requests", "meshline_inference_generated_tokens"} <= names
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, server.tail()
