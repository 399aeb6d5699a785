"""lm-evaluation-harness model `meshline`: any lm-eval task against a Meshline inference server.

Importing this module registers the model (lm-eval 0.4 has no plugin entry points for models),
so run lm-eval through `python -m meshline_client.lm_eval_cli`, which imports it and then runs
lm-eval's own CLI:

```
python -m meshline_client.lm_eval_cli run --model meshline \\
    --model_args endpoint=127.0.0.1:50054 --batch_size 16 --tasks hellaswag
```

Log-likelihoods come from the server's Score RPC (one forward per context, `is_greedy` computed
on the server from the full distribution); generation from Generate with lm-eval's `until` as
stop strings. model_args: endpoint (host:port, required), token, tls_ca, client_cert,
client_key, max_gen_toks (default 256), timeout_s (per call, default 600), add_bos_token
(default False: texts are encoded without the tokenizer's special tokens, as lm-eval's API models
such as `local-completions` encode them; True adds them as the served tokenizer defines, lm-eval's
`add_bos_token=True`); lm-eval's --batch_size sets the requests in flight (default 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshline_client.connection import Connection
from meshline_client.inference import InferenceClient

SCORE_BATCH = 64
"""Score items per RPC (the server's --max-score-items is 1024 by default)."""


@register_model("meshline")
class MeshlineLM(TemplateLM):
    """lm-eval LM backed by a Meshline InferenceService over gRPC."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        tls_ca: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        batch_size: int | str = 16,
        max_gen_toks: int = 256,
        timeout_s: float = 600.0,
        add_bos_token: bool | str = False,
        **_: Any,
    ) -> None:
        super().__init__()
        connection = Connection(
            str(endpoint),
            token=token,
            tls_ca=tls_ca,
            client_cert=client_cert,
            client_key=client_key,
            timeout_s=float(timeout_s),
        )
        self.client = InferenceClient(connection)
        self.info = self.client.model_info()
        self.batch_size = max(1, int(batch_size)) if str(batch_size) != "auto" else 16
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _flag("add_bos_token", add_bos_token)

    @property
    def eot_token_id(self) -> int:
        """End-of-sequence id of the served tokenizer."""
        if self.info.eos_token_id is None:
            raise ValueError("the served tokenizer has no EOS token")
        return self.info.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """BOS when the tokenizer has one (empty contexts are conditioned on it), else EOS."""
        return self.info.bos_token_id if self.info.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Context length of the served model."""
        return self.info.context_length

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        """Token ids from the server's tokenizer: its special tokens only when the caller asks
        or add_bos_token is set (lm-eval's API models' rule; lm-eval adds its own prefix token
        to empty contexts)."""
        add = bool(add_special_tokens) or self.add_bos_token
        return self.client.tokenize(string, add_special_tokens=add)

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), SCORE_BATCH):
            chunk = [self._fit(c, x) for c, x in pairs[start : start + SCORE_BATCH]]
            out += [(s.logprob, s.is_greedy) for s in self.client.score(chunk)]
        return out

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate the context so that context + continuation fit the model."""
        room = self.max_length - len(continuation)
        if room < 1:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit the model's context "
                f"length {self.max_length}"
            )
        return context[-room:], continuation

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self._score([(context, cont) for _key, context, cont in requests])
        for (key, _context, _cont), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Sum of log-probabilities of each whole text, in windows of the context length."""
        out = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(lp for lp, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task sets temperature > 0) continuations, cut at `until`."""

        def run(request: Any) -> str:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            params: dict[str, Any] = {"max_new_tokens": max_new, "stop": until}
            if temperature > 0 and kwargs.pop("do_sample", True):
                params.update(do_sample=True, temperature=temperature)
            prompt = self.tok_encode(context, add_special_tokens=True)
            room = self.max_length - max_new
            if room < 1:
                raise ValueError(
                    f"max_gen_toks {max_new} leaves no room for a prompt in the model's context "
                    f"length {self.max_length}"
                )
            completion = self.client.generate(prompt[-room:], **params)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), completion.text)
            return completion.text

        with ThreadPoolExecutor(self.batch_size) as pool:
            return list(pool.map(run, requests))


def _flag(name: str, value: bool | str) -> bool:
    """A boolean model_arg as lm-eval passes it (a bool, or the text of one)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"model_args {name}={value!r}: give True or False")
