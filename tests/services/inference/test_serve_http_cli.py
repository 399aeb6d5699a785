"""`meshline serve inference --load DIR --http-port 0 --metrics-port 0` as a user starts it.

One process: gRPC, the OpenAI HTTP API and /metrics on three ports, one engine; SIGTERM stops
all of them and the process exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.services.inference.http_served import make_checkpoint

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[3]
PATTERNS = {
    "grpc": re.compile(r"serving \S+ on 127\.0\.0\.1:(\d+)"),
    "http": re.compile(r"OpenAI-compatible HTTP API on http://127\.0\.0\.1:(\d+)/v1"),
    "metrics": re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics"),
}


def test_one_process_serves_grpc_http_and_metrics(tmp_path_factory, sentencepiece_model):
    directory, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=7)
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(directory), "--http-port", "0", "--metrics-port", "0"]
    command += ["--chat-template", "chatml", "--served-model-name", "tiny", "--grace-period", "5"]
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
        assert ready.wait(120) and len(ports) == 3, "".join(lines[-30:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        text = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"meshline_http_requests", "meshline_inference_generated_tokens"} <= names
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, "".join(lines[-30:])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
