"""`meshline serve inference --load SmolLM2` with default flags: memory bounded (#36).

The real SmolLM2-135M-Instruct (8192-token context, 30 layers) used to pre-allocate its KV
cache for 32 rows of the full context: 12.6-13.5 GB of RSS. With the default budget the server
logs what it reserved, stays under 2 GB, and a request past --max-model-len is refused with
HTTP 400 (OpenAI's context_length_exceeded) and gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
import requests

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.served_process import GRPC_PORT, HTTP_PORT, launched

ROOT = Path(__file__).resolve().parents[3]
RSS_LIMIT = 2 * 10**9
PATTERNS = {"grpc": GRPC_PORT, "http": HTTP_PORT}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_default_flags_serve_smollm2_under_2gb(smollm2_dir):
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(smollm2_dir), "--http-port", "0", "--grace-period", "5"]
    with launched(command, PATTERNS) as server:
        lines, ports, process = server.lines, server.ports, server.process
        [reserved] = [line for line in lines if "KV cache:" in line]
        assert "KV cache: paged, " in reserved, reserved
        assert "8192 tokens (the model's context length)" in reserved, reserved
        assert "budget 512.0 MiB (the CPU default" in reserved, reserved
        url = f"http://127.0.0.1:{ports['http']}/v1/completions"
        answer = requests.post(
            url, json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        )
        assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"]
        rss = _rss(process.pid)
        assert rss < RSS_LIMIT, f"RSS {rss / 2**20:.0f} MiB with default flags\n{reserved}"

        too_long = requests.post(url, json={"prompt": [504] * 8190, "max_tokens": 8})
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "8192 (--max-model-len)" in error["message"]
        stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[504] * 8192), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_token_ids" in caught.value.details()
        assert "--max-model-len" in caught.value.details()
