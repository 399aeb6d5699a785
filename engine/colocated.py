"""An engine over a module that is being trained: rollouts that read the weights in place.

Online RL (training/objectives/grpo.py) generates its completions with the policy's current
weights. As DeepSpeed-Chat's hybrid engine, the engine here runs the training module itself: its
decode paths hold the parameters (the lean step holds the tensors, the C step their addresses),
and an optimizer updates them in place, so a step's new weights are what the next rollout reads
with no copy and no reload. `weight_bytes_copied()` measures that: the bytes of parameters whose
storage moved since the engine was built (0 when the updates were in place; a moved storage is
refused, since the C step would read the old one). The weight layout stays dense (a packed or
column-major layout would rewrite the weights the optimizer updates) and CUDA graphs are off
(they capture the KV cache, which is freed between rollouts). On CPU the engine moves the weights
into huge pages once when it is built (kernels/cpu/hugepages.py, counted in `build_bytes_moved`),
keeping the Parameter objects the optimizer holds.

Decode path: with dense fp32 (or bf16) weights the engine runs every step of up to 64 rows in
one C call (engine/native_step.py, cpu_decode.c), which reads each weight through the address
of the parameter's own storage; nothing is packed or copied, and an in-place optimizer step is
what the next rollout reads. A group's prompt is prefilled once and its KV row copied to the
group's other samples (Engine._prefill), and sampling draws one number a row (sample_rows).

Between rollouts the KV cache is released (`sleep`: a one-row, two-slot stand-in) so training
has the memory; `generate` reserves it again for the rollout and releases it after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.requests import SequenceResult
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models.tokenizer import Tokenizer
from models.transformer import CausalLM


def _storage(model: CausalLM) -> dict[str, tuple[int, int]]:
    """Each parameter's (data address, bytes)."""
    return {
        name: (param.data_ptr(), param.numel() * param.element_size())
        for name, param in model.named_parameters()
    }


@dataclasses.dataclass(frozen=True)
class RolloutSampling:
    """How rollouts sample (trl's GRPOConfig names)."""

    max_completion_length: int = 256
    """New tokens per completion at most (--max-completion-length)."""
    temperature: float = 1.0
    """Softmax temperature (--temperature); 0 is greedy (evaluation)."""
    top_p: float = 1.0
    """Nucleus sampling mass (--top-p); 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens (--top-k); 0 disables."""


class _DenseEngine(Engine):
    """An Engine with dense KV rows: sleep/wake resize its cache between rollouts
    (`Engine.resize_cache`; a paged pool's block tables are not released this way yet)."""

    pages_kv = False


class ColocatedEngine:
    """Generates with the weights of the module being trained, in place."""

    def __init__(
        self,
        model: CausalLM,
        tokens: TokenizerInfo,
        config: EngineConfig | None = None,
        sampling: RolloutSampling | None = None,
    ) -> None:
        config = config or EngineConfig(cpu_linear="dense")
        if config.cpu_linear != "dense" or config.compile_decode:
            raise ValueError(
                "colocated rollouts read the trained weights as they are: --cpu-linear must be "
                f"dense (got {config.cpu_linear}) and --compile-decode off"
            )
        config = dataclasses.replace(config, enforce_eager=True)
        self.model = model
        self.sampling = sampling or RolloutSampling()
        before = _storage(model)
        self.engine = _DenseEngine(model, tokens, config)
        self._storage = _storage(model)
        self.build_bytes_moved = sum(
            size for name, (ptr, size) in self._storage.items() if before[name][0] != ptr
        )
        """Bytes the engine moved once when built (into huge pages on CPU; 0 elsewhere)."""
        self._rows = self.engine.pool.max_rows
        self._max_len = self.engine.max_seq_len
        self.sleep()

    def weight_bytes_copied(self) -> int:
        """Bytes of parameters whose storage moved since the engine was built (0: in place)."""
        now = _storage(self.model)
        return sum(size for name, (ptr, size) in now.items() if self._storage[name][0] != ptr)

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now."""
        cache = self.engine.pool.cache
        stores = (*cache.k_BSKD.values(), *cache.v_BSKD.values())
        return sum(t.numel() * t.element_size() for t in stores)

    def sleep(self) -> None:
        """Release the KV cache (keep a one-row, two-slot stand-in)."""
        self.engine.resize_cache(1, 2)

    def wake(self, rows: int | None = None, slots: int | None = None) -> None:
        """Allocate the KV cache again for a rollout: `rows` rows (at most --max-batch-rows)
        of `slots` slots (at most --max-model-len); the largest by default."""
        rows = self._rows if rows is None else min(rows, self._rows)
        slots = self._max_len if slots is None else min(slots, self._max_len)
        self.engine.resize_cache(rows, slots)

    @torch.no_grad()
    def generate(
        self, model: torch.nn.Module, prompts: Sequence[list[int]], seeds: Sequence[int], n: int
    ) -> list[list[SequenceResult]]:
        """`n` samples per prompt (prompt i's sampler seeded seeds[i], sample j seeds[i] + j),
        with the weights as they are now; the KV cache lives only for the call."""
        if model is not self.model:
            raise ValueError("ColocatedEngine.generate: another module than the one it runs")
        moved = self.weight_bytes_copied()
        if moved:
            raise RuntimeError(
                f"colocated rollouts: {moved} bytes of parameters changed storage since the "
                "engine was built; the optimizer must update them in place"
            )
        sampling = self.sampling
        configs = [
            SamplingConfig(
                max_new_tokens=sampling.max_completion_length,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                num_return_sequences=n,
                seed=int(seed),
            )
            for seed in seeds
        ]
        was_training = model.training
        model.eval()
        # Only as many rows and slots as this call can use: zeroing the cache is part of its time.
        longest = max((len(p) for p in prompts), default=0) + sampling.max_completion_length
        self.wake(len(prompts) * n, longest)
        try:
            return self.engine.generate(list(prompts), configs)
        finally:
            self.engine.reset()
            self.sleep()
            model.train(was_training)


def colocated_engine(
    model: CausalLM,
    tokenizer: Tokenizer | None,
    *,
    max_model_len: int,
    max_batch_rows: int = 32,
    sampling: RolloutSampling | None = None,
) -> ColocatedEngine:
    """The colocated engine a trainer builds over its policy: dense weights, rows of at most
    `max_model_len` tokens (prompt + completion), the tokenizer's EOS ending completions."""
    tokens = TokenizerInfo.from_tokenizer(tokenizer, model.config.vocab_size)
    config = EngineConfig(
        cpu_linear="dense", max_model_len=max_model_len, max_batch_rows=max_batch_rows
    )
    return ColocatedEngine(model, tokens, config, sampling)
