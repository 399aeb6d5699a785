"""/metrics after real gRPC and HTTP traffic, parsed with prometheus_client's own parser."""

from __future__ import annotations

import time

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from meshline.inference.v1 import inference_pb2 as pb
from services.common.metrics import start_metrics_server
from tests.services.inference.http_served import ServerHarness, make_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=3)
    harness = ServerHarness(directory, hf, config, max_concurrent_requests=4)
    served = harness.start()
    metrics = start_metrics_server("127.0.0.1", 0)
    yield served, f"http://127.0.0.1:{metrics.server_port}/metrics"
    metrics.shutdown()
    metrics.server_close()
    harness.close()


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(url, timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _value(samples, name: str, **labels) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, got), v in samples.items() if n == name and set(want) <= set(got))


def _scrape_when(url: str, settled, timeout: float = 10.0) -> dict[tuple[str, tuple], float]:
    """Scrapes until `settled(samples)` holds or `timeout` passes; returns the last scrape.

    A call is counted when its handler finishes, and grpc's `context.abort` sends the status to
    the client before the handler's `finally` runs: on a loaded machine the client can see the
    error a moment before the counter moves. Prometheus promises no more than that, so the
    tests wait for the count (and then assert it exactly) rather than race it.
    """
    deadline = time.monotonic() + timeout
    samples = _scrape(url)
    while not settled(samples) and time.monotonic() < deadline:
        time.sleep(0.02)
        samples = _scrape(url)
    return samples


def test_counters_move_with_traffic(served):
    served, url = served
    before = _scrape(url)
    served.grpc_stub.Generate(
        pb.GenerateRequest(prompt="one two", params=pb.SamplingParams(max_new_tokens=5)),
        timeout=60,
    )
    body = {"model": served.model_name, "prompt": "the cat", "max_tokens": 4, "temperature": 0}
    assert requests.post(f"{served.http_url}/v1/completions", json=body, timeout=60).ok
    bad = {**body, "temperature": 7}
    assert (
        requests.post(f"{served.http_url}/v1/completions", json=bad, timeout=60).status_code == 400
    )
    http_400 = dict(route="/v1/completions", method="POST", status="400")
    after = _scrape_when(
        url,
        lambda now: (
            _value(now, "meshline_http_requests_total", **http_400)
            > _value(before, "meshline_http_requests_total", **http_400)
        ),
    )

    def moved(name: str, **labels) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    grpc_labels = dict(service="meshline.inference.v1.InferenceService", method="Generate")
    assert moved("meshline_grpc_requests_total", code="OK", **grpc_labels) == 1
    assert moved("meshline_grpc_request_duration_seconds_count", **grpc_labels) == 1
    route = dict(route="/v1/completions", method="POST")
    assert moved("meshline_http_requests_total", status="200", **route) == 1
    assert moved("meshline_http_requests_total", status="400", **route) == 1
    assert moved("meshline_inference_requests_total", protocol="grpc") == 1
    assert moved("meshline_inference_requests_total", protocol="http") == 1
    assert moved("meshline_inference_generated_tokens_total") >= 2
    assert moved("meshline_inference_time_to_first_token_seconds_count") == 2
    assert moved("meshline_inference_inter_token_latency_seconds_count") >= 1
    assert moved("meshline_inference_batch_size_count") >= 5
    assert moved("meshline_inference_engine_steps_total") >= 5
    assert ("meshline_inference_kv_cache_rows_usage_ratio", ()) in after
    assert ("meshline_inference_queue_depth", ()) in after


def test_grpc_errors_are_counted_by_code(served):
    served, url = served
    before = _scrape(url)
    with pytest.raises(grpc.RpcError):
        served.grpc_stub.Generate(pb.GenerateRequest(), timeout=30)
    name = "meshline_grpc_requests_total"
    labels = dict(method="Generate", code="INVALID_ARGUMENT")
    after = _scrape_when(
        url, lambda now: _value(now, name, **labels) > _value(before, name, **labels)
    )
    assert _value(after, name, **labels) - _value(before, name, **labels) == 1


def test_operations_collector_counts_states(served):
    from services.common.operations import OperationsStore

    _, url = served
    store = OperationsStore(None)
    store.create("metrics-test")
    running = store.create("metrics-test")
    running.start()
    running.progress(3, 12, "steps")
    samples = _scrape(url)
    assert _value(samples, "meshline_operations", kind="metrics-test", state="pending") == 1
    assert _value(samples, "meshline_operations", kind="metrics-test", state="running") == 1
    ratio = _value(samples, "meshline_operation_progress_ratio", kind="metrics-test")
    assert ratio == pytest.approx(0.25)


def test_prefix_cache_hits_and_blocks_are_exported(served):
    served, url = served
    before = _scrape(url)
    shared = " ".join(["one two three four five six seven eight"] * 2)
    for tail in ("nine", "ten"):
        served.grpc_stub.Generate(
            pb.GenerateRequest(
                prompt=f"{shared} {tail}", params=pb.SamplingParams(max_new_tokens=2)
            ),
            timeout=60,
        )
    after = _scrape(url)

    def moved(name: str) -> float:
        return _value(after, name) - _value(before, name)

    # The second prompt finds the full 16-token blocks of the first that the words share.
    hits, queries = (
        moved("meshline_inference_prefix_cache_hits_total"),
        moved("meshline_inference_prefix_cache_queries_total"),
    )
    assert hits >= 32 and hits % 16 == 0 and queries >= 2 * hits
    assert _value(after, "meshline_inference_kv_cache_blocks_free") > 0
    assert ("meshline_inference_kv_cache_blocks_used", ()) in after
