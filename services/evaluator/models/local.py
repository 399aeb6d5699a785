"""`LocalLanguageModel`: the inference service's engine loaded into the evaluator's process.

`--load DIR [--load-format hf|native|megatron]`: the engine is built with
`engine.build.build_engine` on this process's device; scoring runs the engine's
`score` (the service's Score path, `engine/scoring.py`), generation its batched
greedy decoding.
"""

from __future__ import annotations

from pathlib import Path

from services.evaluator.models.base import GenerationRequest, LanguageModel, SpecialTokens


class LocalLanguageModel(LanguageModel):
    """A checkpoint served in-process."""

    def __init__(
        self,
        load_dir: Path,
        *,
        load_format: str = "auto",
        tokenizer: Path | None = None,
        batch_size: int = 8,
        add_bos_token: bool | None = None,
        dtype: str = "auto",
    ) -> None:
        from engine.build import LoadSpec, build_engine
        from engine.config import EngineConfig
        from kernels import device as devices

        self.name = str(load_dir)
        self.flag = "--load"
        self.add_bos_token = add_bos_token
        self._loaded, self._engine = build_engine(
            LoadSpec(Path(load_dir), load_format, tokenizer),
            EngineConfig(max_batch_rows=max(1, batch_size), dtype=dtype),
            device=devices.current().torch_device(),
        )
        if self._loaded.tokenizer is None:
            raise ValueError(
                f"--load {load_dir}: the checkpoint holds no tokenizer; give --tokenizer PATH"
            )
        tokens = self._engine.tokens
        self._pad = tokens.pad_id or 0

    @property
    def context_length(self) -> int:
        """The model's max_position_embeddings."""
        return int(self._engine.context_length)

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The checkpoint tokenizer's ids (as the service's Tokenize)."""
        tokenizer = self._engine.tokens.require()
        return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    @property
    def special_tokens(self) -> SpecialTokens:
        """BOS and lm-eval's prefix token of the checkpoint's tokenizer."""
        tokens = self._engine.tokens
        prefix = tokens.prefix_id  # None: only empty contexts fail

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokens.detokenize([token_id], skip_special=False)

        return SpecialTokens(tokens.bos_id, text(tokens.bos_id), prefix, text(prefix))

    def score_ids(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """The engine's `score` (the service's Score path) over all items at once: choices
        sharing a context run it once, repeated items run once."""
        prefix = self._engine.tokens.prefix_id
        fixed = [(c or [prefix if prefix is not None else self._pad], x) for c, x in items]
        return [(r.logprob, r.is_greedy) for r in self._engine.score(fixed, pad_id=self._pad)]

    def generate_ids(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[str]:
        """Decoding of all prompts together (continuous batching)."""
        from engine.sampling import SamplingConfig

        configs = [
            SamplingConfig(
                max_new_tokens=r.max_new_tokens,
                stop=r.until,
                seed=r.seed,
                do_sample=r.temperature is not None,
                temperature=r.temperature or 1.0,
            )
            for r in requests
        ]
        results = self._engine.generate(prompts, configs)
        return [r[0].text for r in results]
