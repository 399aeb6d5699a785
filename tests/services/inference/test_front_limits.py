"""Fronts that keep their limits (#37 finding 5): bounded metrics labels, bodies parsed off loop.

- 7,000 made-up HTTP methods grew `/metrics` from 47 KB to 13.5 MB (one series per method,
  recorded before auth): now labels come from fixed sets and a failed auth chooses none, so the
  scrape's byte count must not grow with more made-up methods.
- four 16 MiB JSON bodies, decoded and validated on the event loop shared with gRPC, stalled gRPC
  health for 9.6 s: now every health call made while large bodies are posted answers within 1 s.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServerConfig
from services.common.metrics import start_metrics_server
from services.inference import http_body
from tests.services.inference.http_served import ServerHarness, make_checkpoint

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=7)
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text("s3cret\n")
    harness = ServerHarness(directory, hf, config, max_request_mb=8)
    served = harness.start(ServerConfig(host="127.0.0.1", port=0, auth_token_file=str(token_file)))
    metrics = start_metrics_server("127.0.0.1", 0)
    yield served, f"http://127.0.0.1:{metrics.server_port}/metrics"
    metrics.shutdown()
    metrics.server_close()
    harness.close()


def _made_up(url: str, count: int, start: int, headers: dict[str, str]) -> None:
    with requests.Session() as session:
        for i in range(start, start + count):
            session.request(f"XM{i:05d}", url, headers=headers, timeout=10)


def _scrape(url: str) -> tuple[int, int]:
    """(bytes, lines) of one scrape."""
    text = requests.get(url, timeout=10).text
    return len(text.encode()), text.count("\n")


def test_made_up_methods_add_no_metric_series(served):
    served, metrics_url = served
    url, unknown = f"{served.http_url}/v1/models", f"{served.http_url}/made/up/path"
    _made_up(url, 2, 0, AUTH)  # the "other" series exist from here on
    _made_up(url, 2, 2, {})
    _made_up(unknown, 2, 4, AUTH)
    before_bytes, before_lines = _scrape(metrics_url)
    _made_up(url, 100, 10, AUTH)
    _made_up(url, 100, 1000, {})  # unauthenticated: not even its route is a label
    _made_up(unknown, 20, 2000, AUTH)
    after_bytes, after_lines = _scrape(metrics_url)
    assert after_lines == before_lines  # no new series
    # Only counter values and histogram sums change (a few digits each), not the series.
    assert after_bytes - before_bytes < 300, (before_bytes, after_bytes)
    text = requests.get(metrics_url, timeout=10).text
    assert "XM0" not in text and "made/up" not in text


def _ints_body(model: str, megabytes: int) -> bytes:
    count = megabytes * 1024 * 1024 // 3
    return json.dumps({"model": model, "prompt": [1] * count, "max_tokens": 1}).encode()


def test_grpc_health_answers_within_a_second_while_large_bodies_are_parsed(served):
    served, _ = served
    body = _ints_body(served.model_name, 4)
    channel = grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}")
    health = health_pb2_grpc.HealthStub(channel)
    health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    statuses: list[int] = []

    def post() -> None:
        reply = requests.post(
            f"{served.http_url}/v1/completions",
            data=body,
            headers={**AUTH, "content-type": "application/json"},
            timeout=120,
        )
        statuses.append(reply.status_code)

    posts = [threading.Thread(target=post) for _ in range(4)]
    for thread in posts:
        thread.start()
    worst, checks = 0.0, 0
    while any(thread.is_alive() for thread in posts):
        started = time.monotonic()
        health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        worst = max(worst, time.monotonic() - started)
        checks += 1
        time.sleep(0.05)
    for thread in posts:
        thread.join()
    channel.close()
    assert worst < 1.0, f"gRPC health took {worst:.2f} s while large bodies were parsed"
    assert checks >= 3, "the bodies were handled too fast to measure anything"
    assert statuses == [400] * 4  # over the model's context: refused after parsing, not stalled


def test_a_full_parse_queue_answers_429(served, monkeypatch):
    served, _ = served
    full = http_body.BodyPool(workers=0, max_pending=1)  # never started: no room at all
    monkeypatch.setattr(http_body, "POOL", full)
    reply = requests.post(
        f"{served.http_url}/v1/completions",
        data=_ints_body(served.model_name, 1),
        headers={**AUTH, "content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 429 and "large request bodies" in reply.json()["error"]["message"]


LOAD_GAUGES = (
    "meshline_inference_queue_depth",
    "meshline_inference_running_rows",
    "meshline_inference_kv_cache_rows_usage_ratio",
    "meshline_inference_kv_cache_tokens_usage_ratio",
)


def _gauges(url: str) -> dict[str, float]:
    text = requests.get(url, timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in LOAD_GAUGES:
            values[name] = float(value)
    return values


def test_load_gauges_read_zero_on_an_idle_server(served):
    served, metrics_url = served
    body = {"model": served.model_name, "prompt": "the cat", "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        reply = requests.post(
            f"{served.http_url}/v1/completions", json=body, headers=AUTH, timeout=60
        )
        assert reply.ok
    deadline = time.monotonic() + 5
    while served.engine.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    gauges = _gauges(metrics_url)
    assert set(gauges) == set(LOAD_GAUGES)
    assert gauges == dict.fromkeys(LOAD_GAUGES, 0.0)  # the running-rows and KV-rows ones were 1
