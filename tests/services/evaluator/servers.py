"""Real gRPC servers for evaluator tests: a tiny HF Llama with a trained sentencepiece tokenizer
served by Meshline's InferenceService, each server in its own event-loop thread on port 0."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch

from services.common.config import ServerConfig
from services.common.server import ServiceBinding, create_server
from tests.services.evaluator.lm_eval_ref import FIXTURES

CONTEXT_LENGTH = 192


class ServerThread:
    """A grpc.aio server hosting `bindings` on 127.0.0.1:<free port> until `stop()`."""

    def __init__(self, bindings: list[ServiceBinding]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            create_server(bindings, ServerConfig(host="127.0.0.1", port=0)), self._loop
        )
        self._server, self.port, _ = future.result(timeout=60)

    @property
    def address(self) -> str:
        """host:port to dial."""
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop the server, cancel what still runs on its loop (the engine loop), stop the loop."""

        async def shutdown() -> None:
            await self._server.stop(0)
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def train_fixture_tokenizer(directory: Path) -> Path:
    """A 512-piece sentencepiece model trained on the evaluator fixture texts (ids 0-3: unk, bos,
    eos, pad); returns the `.model` path."""
    from models.tokenizer import train_sentencepiece

    corpus = directory / "corpus.txt"
    texts = [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*")) if p.is_file()]
    corpus.write_text("\n".join(texts) * 3, encoding="utf-8")
    return train_sentencepiece([corpus], directory / "sp", 512)


def write_tiny_checkpoint(directory: Path) -> Path:
    """An HF Llama checkpoint (random weights, seeded) with a sentencepiece tokenizer trained on
    the fixture texts; returns the checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.services.inference.helpers import save_hf_checkpoint

    sp_model = train_fixture_tokenizer(directory)
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_file=str(sp_model)).vocab_size()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    return save_hf_checkpoint(hf, directory / "ckpt", sp_model)


def inference_server(checkpoint: Path) -> ServerThread:
    """Meshline's InferenceService serving `checkpoint`."""
    from services.inference.config import InferenceServiceConfig
    from services.inference.servicer import bindings, load_engine

    config = InferenceServiceConfig(load=checkpoint, load_format="hf")
    return ServerThread(bindings(config, load_engine(config)))
