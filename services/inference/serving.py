"""What one inference server holds: the loaded model, its engine and the async loop feeding it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import AsyncEngine
from engine.build import build_engine
from engine.engine import Engine
from engine.engine_thread import EngineThread
from engine.loading import LoadedModel
from engine.quantized_model import parameter_count
from engine.tokens import TokenizerInfo
from engine.validation import RequestLimits
from kernels import device as devices
from models.accounting import count_parameters
from services.inference.config import InferenceServiceConfig


@dataclass
class ServingEngine:
    """A loaded model with its engine; `front` (the asyncio side) starts on first use."""

    loaded: LoadedModel
    engine: Engine
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    children: list[Any] = field(default_factory=list)
    worker: EngineThread | None = None
    """The thread that loaded the model and runs its steps (None: the front starts one)."""
    rendezvous: Any = None
    """The multi-process group's TCPStore, hosted here (held for as long as the group lives)."""
    _front: AsyncEngine | None = None

    @property
    def front(self) -> AsyncEngine:
        """The async engine front (created on first use, driving the engine on `worker`)."""
        if self._front is None:
            self._front = AsyncEngine(self.engine, self.worker)
        return self._front

    @property
    def tokens(self) -> TokenizerInfo:
        """Vocabulary and tokenizer of the served model."""
        return self.engine.tokens

    @property
    def dtype_name(self) -> str:
        """Compute dtype as the proto spells it."""
        return str(next(self.loaded.model.parameters()).dtype).removeprefix("torch.")

    def num_parameters(self) -> int:
        """Parameters of the whole model (tied matrices once; every shard and stage counted)."""
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            return int(count_parameters(self.loaded.config))
        return parameter_count(self.loaded.model)

    def stop(self, grace_s: float) -> None:
        """Server on_stop hook: release tensor-parallel followers and wait for them to exit."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            self.front.run_blocking(shutdown, grace_s)
            for child in self.children:
                child.join(grace_s)
        if self.worker is not None:
            self.worker.stop(grace_s)


def build_serving_engine(config: InferenceServiceConfig) -> ServingEngine:
    """Load `config.load` on this process's device and wrap it in an engine.

    Loading, the engine's set-up and later every step run on one `EngineThread` (see there).
    """
    assert config.load is not None
    worker = EngineThread(batch_wait_s=config.batch_wait_ms / 1e3)
    try:
        loaded, engine = worker.call(lambda: _load(config)).result()
    except BaseException:
        worker.stop()
        raise
    return ServingEngine(loaded, engine, worker=worker)


def _load(config: InferenceServiceConfig) -> tuple[LoadedModel, Engine]:
    loaded, engine = build_engine(
        config.load_spec(), config.engine_config(), device=devices.current().torch_device()
    )
    for module in config.lora_modules:
        label = f"--lora-modules {module.name}"
        assert engine.adapters is not None  # --lora-modules implies --enable-lora
        engine.install_adapter(engine.adapters.prepare(module.name, module.path, label), label)
    return loaded, engine


def request_limits(
    config: InferenceServiceConfig, engine: ServingEngine | None = None
) -> RequestLimits:
    """The limits one request meets: the service's flags, and the engine's capacity if loaded."""
    fit = engine.engine.request_limits() if engine is not None else RequestLimits()
    return RequestLimits(
        max_new_tokens=config.max_new_tokens_limit,
        max_num_beams=config.max_num_beams,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
        max_prompt_chars=config.max_text_chars,
        max_model_len=fit.max_model_len,
        max_rows=fit.max_rows,
        vocab_size=fit.vocab_size,
    )
