"""`LocalLanguageModel`: the inference service's engine loaded into the evaluator's process.

`--load DIR [--load-format hf|native|megatron]`: the engine is built with
`engine.build.build_engine` on this process's device; scoring runs the engine's
`score` (the service's Score path, `engine/scoring.py`), generation its batched
greedy decoding. A reward model (a value head, `meshline train --stage rm`) is loaded with
`engine.build.build_reward_model` instead and answers reward tasks only (`engine/reward.py`,
the service's Reward path).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.evaluator.models.base import GenerationRequest, LanguageModel, SpecialTokens

if TYPE_CHECKING:
    from engine.engine import Engine


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
        flag: str = "--load",
    ) -> None:
        # imported here: the engine loads torch; an --endpoint evaluation never does
        from engine.build import LoadSpec, build_engine, build_reward_model
        from engine.config import EngineConfig
        from engine.loading import is_reward_checkpoint
        from engine.reward import RewardScorer
        from engine.tokens import TokenizerInfo
        from kernels import device as devices

        self.name = str(load_dir)
        self.flag = flag  # the flag that named the checkpoint, for errors
        self.add_bos_token = add_bos_token
        spec = LoadSpec(Path(load_dir), load_format, tokenizer)
        device = devices.current().torch_device()
        self._engine: Engine | None = None
        self._scorer: RewardScorer | None = None
        if is_reward_checkpoint(spec.path, load_format):
            self._loaded, self._scorer = build_reward_model(spec, device=device)
            self._context = self._loaded.config.max_position_embeddings
        else:
            self._loaded, self._engine = build_engine(
                spec, EngineConfig(max_batch_rows=max(1, batch_size), dtype=dtype), device=device
            )
            self._context = self._engine.context_length
        if self._loaded.tokenizer is None:
            raise ValueError(
                f"{flag} {load_dir}: the checkpoint holds no tokenizer; "
                + ("give --tokenizer PATH" if flag == "--load" else "store one in it")
            )
        self._tokens = TokenizerInfo.from_tokenizer(
            self._loaded.tokenizer, self._loaded.config.vocab_size
        )
        self._pad = self._tokens.pad_id or 0

    @property
    def context_length(self) -> int:
        """The model's max_position_embeddings."""
        return int(self._context)

    @property
    def is_reward_model(self) -> bool:
        """Whether the checkpoint is a reward model (a scalar value head)."""
        return self._scorer is not None

    def _causal_engine(self) -> Engine:
        if self._engine is None:
            raise ValueError(
                f"{self.flag} {self.name} is a reward model (a scalar value head): it answers reward "
                "tasks (rm_pairs) only; log-likelihood and generation tasks need a causal LM"
            )
        return self._engine

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The checkpoint tokenizer's ids (as the service's Tokenize)."""
        tokenizer = self._tokens.require()
        return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    @property
    def special_tokens(self) -> SpecialTokens:
        """BOS, EOS and lm-eval's prefix token of the checkpoint's tokenizer."""
        tokens = self._tokens
        prefix = tokens.prefix_id  # None: only empty contexts fail

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokens.detokenize([token_id], skip_special=False)

        return SpecialTokens(
            tokens.bos_id, text(tokens.bos_id), prefix, text(prefix), eos_id=tokens.eos_id
        )

    def reward_ids(self, rows: list[list[int]]) -> list[float]:
        """The reward model's score of each row (the service's Reward path)."""
        if self._scorer is None:
            return super().reward_ids(rows)  # refused: a causal LM
        return self._scorer.score(rows)

    def score_ids(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """The engine's `score` (the service's Score path) over all items at once: choices
        sharing a context run it once, repeated items run once."""
        engine = self._causal_engine()
        prefix = self._tokens.prefix_id
        fixed = [(c or [prefix if prefix is not None else self._pad], x) for c, x in items]
        return [(r.logprob, r.is_greedy) for r in engine.score(fixed, pad_id=self._pad)]

    def generate_ids(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[str]:
        """Decoding of all prompts together (continuous batching)."""
        # imported here: engine.sampling loads torch (see __init__)
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
        results = self._causal_engine().generate(prompts, configs)
        return [r[0].text for r in results]
