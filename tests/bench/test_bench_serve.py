"""bench_serve's HTTP clients put every request of a batch in flight together (issue #21).

Its old client ran the calls through `asyncio.to_thread`, whose default executor has
min(32, CPUs + 4) workers: on a 2-core machine only 6 of 8 requests were in flight, the server
decoded a batch of 6 and then one of 2, and HTTP looked 1.3-2 ms per step slower than gRPC.
Here a local server holds every request until `batch` of them are open at once; a client that
caps its concurrency below `batch` breaks the barrier and the calls fail.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bench.bench_serve import HttpClient, OpenAIClient

BARRIER_TIMEOUT_S = 20.0


class _Completions(BaseHTTPRequestHandler):
    """Answers /v1/completions like the server with no tokenizer: `token_id:<id>` strings."""

    barrier: threading.Barrier
    lock = threading.Lock()
    open_now = 0
    most_open = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.open_now += 1
            cls.most_open = max(cls.most_open, cls.open_now)
        try:
            cls.barrier.wait()  # every request of the batch is open at once, or this breaks
            status = 200
            tokens = [f"token_id:{t + 1}" for t in body["prompt"][: body["max_tokens"]]]
            reply: dict[str, Any] = {"choices": [{"logprobs": {"tokens": tokens}}]}
        except threading.BrokenBarrierError:
            status, reply = 503, {"error": "the batch was never in flight together"}
        finally:
            with cls.lock:
                cls.open_now -= 1
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # /v1/models, which the openai client asks first
        data = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # the default backlog of 5 resets simultaneous connections


async def _generate_and_close(client: Any, prompts: list[list[int]]) -> list[list[int]]:
    try:
        return await client.generate(prompts, 2)
    finally:
        await client.close()


@pytest.mark.parametrize("client_class", [HttpClient, OpenAIClient])
@pytest.mark.parametrize("batch", [8, 16])
def test_http_clients_have_every_request_in_flight_together(batch: int, client_class) -> None:
    handler = type(
        "Handler", (_Completions,), {"barrier": threading.Barrier(batch, timeout=BARRIER_TIMEOUT_S)}
    )
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        prompts = [[i, i + 100] for i in range(batch)]
        client = client_class(server.server_address[1])
        got = asyncio.run(_generate_and_close(client, prompts))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert handler.most_open == batch
    assert got == [[t + 1 for t in p] for p in prompts]


def test_a_token_difference_is_explained_with_the_margin_and_hf_alone(tmp_path, capsys) -> None:
    """bench_serve's diagnosis of a differing row: the first differing step, HF's top-2 logits
    there, and whether ours equals HF's tokens for the prompt generated alone."""
    from bench.bench_serve import explain_difference, hf_generate, write_checkpoint

    shape = dict(vocab=64, hidden=32, ffn=64, layers=1, heads=2, kv=1)
    hf = write_checkpoint(shape, tmp_path / "ckpt")
    prompts = [[1, 2, 3], [4, 5, 6]]
    theirs = hf_generate(hf, prompts, 4)
    ours = [list(theirs[0]), list(theirs[1])]
    ours[1][2] = (ours[1][2] + 1) % 64
    explain_difference(hf, prompts, ours, theirs)
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert len(lines) == 1  # row 0 is identical and not reported
    assert lines[0].startswith("    row 1: first differs at new token 2, HF's top-2 logits ")
    assert (
        "ours differs from HF's tokens for this prompt alone, which equal HF's batched" in lines[0]
    )


def test_bf16_checkpoint_and_agreement_count(tmp_path) -> None:
    """`--dtype bfloat16`: the checkpoint is stored in bf16 (the server's `--dtype auto` loads
    bf16), the returned HF model holds the same rounded values in fp32; `agreeing` counts the
    leading tokens equal to the reference, median over rows."""
    import torch
    from safetensors.torch import load_file

    from bench.bench_serve import agreeing, write_checkpoint
    from engine.loading import load_checkpoint

    shape = dict(vocab=64, hidden=32, ffn=64, layers=1, heads=2, kv=1)
    hf = write_checkpoint(shape, tmp_path / "ckpt", dtype="bfloat16")
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(hf.state_dict()[name], stored[name].float())
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert agreeing([[1, 2, 3], [1, 5, 6], [7, 8, 9]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]]) == 1
