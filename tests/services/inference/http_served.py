"""A real inference server on localhost: gRPC and the OpenAI-compatible HTTP front on one engine.

Both run in one background event loop, as `meshline serve inference --load DIR --http-port 0`
runs them; tests call them with real clients (grpc, openai, requests, lm-eval).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig
from services.inference.http_config import HttpConfig
from services.inference.http_server import start_http
from services.inference.servicer import bindings, load_engine
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint


@dataclass
class Served:
    """What a test gets: clients' addresses, the engine, the HF reference model."""

    grpc_stub: pb_grpc.InferenceServiceStub
    grpc_port: int
    http_url: str
    engine: Any
    hf: Any
    config: Any
    model_name: str
    loop: asyncio.AbstractEventLoop


class ServerHarness:
    """Starts and stops the servers in a background loop."""

    def __init__(
        self,
        directory: Path,
        hf: Any,
        config: Any,
        tokenizer: Path | None = None,
        limits: InferenceServiceConfig | None = None,
        runtime_lora: bool = False,
        **http_overrides: Any,
    ) -> None:
        self.limits = limits or InferenceServiceConfig(
            load=directory, max_batch_rows=8, tokenizer=tokenizer
        )
        self.runtime_lora = runtime_lora
        self.engine = load_engine(self.limits)
        self.http = HttpConfig(**{"http_port": 0, "chat_template": "chatml", **http_overrides})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.hf, self.config = hf, config
        self.fronts: list[Any] = []

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, server_config: ServerConfig | None = None) -> Served:
        server_config = server_config or ServerConfig(host="127.0.0.1", port=0)
        server, port, _ = self.call(
            create_server(
                bindings(self.limits, self.engine, self.http, self.runtime_lora), server_config
            )
        )
        front = self.call(start_http(self.engine, self.limits, self.http, server_config))
        self.fronts.append((server, front))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        scheme = "https" if server_config.tls else "http"
        return Served(
            pb_grpc.InferenceServiceStub(channel),
            port,
            f"{scheme}://127.0.0.1:{front.port}",
            self.engine,
            self.hf,
            self.config,
            self.engine.loaded.name,
            self.loop,
        )

    def close(self) -> None:
        for server, front in self.fronts:
            self.call(front.stop(1))
            self.call(server.stop(0))
        self.call(self.engine.front.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_checkpoint(tmp_path_factory: Any, sentencepiece_model: Path, seed: int = 2):
    """(directory, HF model, model config) of a tiny llama with the fixture tokenizer."""
    hf, _, config = hf_reference("llama-gqa", seed=seed, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    return directory, hf, config
