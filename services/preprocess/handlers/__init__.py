"""Prompt handlers by name (`--handler-name`); `module:Class` loads a user's own Handler subclass.

| name | input records | outputs |
| --- | --- | --- |
| GeneralPretrainHandler | `--json-keys` text fields | `{prefix}_{key}_document` per key |
| GeneralInstructionHandler (alpaca) | instruction / input / output | packed_{input_ids,attention_mask,labels} |
| BelleMultiTurnInstructionHandler (belle) | conversations from/value | same three |
| MOSSInstructionHandler (moss) | meta_instruction + chat.turn_N | same three |
| LeetcodePythonInstructionHandler (leetcode) | content + python | same three |
| SharegptInstructionHandler (sharegpt) | conversations / messages | same three |
| pairwise handlers (handlers/preference.py) | prompt / chosen / rejected layouts | {chosen,rejected}_{input_ids,labels} |
"""

from __future__ import annotations

import importlib

from services.preprocess.handlers.base import (
    IGNORE_INDEX,
    INSTRUCTION_KEYS,
    PAIRWISE_KEYS,
    Handler,
    HandlerOptions,
    RecordError,
    Sample,
)
from services.preprocess.handlers.conversation import (
    BelleMultiTurnInstructionHandler,
    SharegptInstructionHandler,
)
from services.preprocess.handlers.instruction import (
    GeneralInstructionHandler,
    LeetcodePythonInstructionHandler,
)
from services.preprocess.handlers.moss import MOSSInstructionHandler
from services.preprocess.handlers.preference import (
    AlpacaStylePairwiseHandler,
    HHRLHFPairwiseHandler,
    PreferencePairwiseHandler,
    RMStaticPairwiseHandler,
    SharegptStylePairwiseHandler,
)
from services.preprocess.handlers.pretrain import GeneralPretrainHandler

HANDLERS: dict[str, type[Handler]] = {
    cls.name: cls
    for cls in (
        GeneralPretrainHandler,
        GeneralInstructionHandler,
        BelleMultiTurnInstructionHandler,
        MOSSInstructionHandler,
        LeetcodePythonInstructionHandler,
        SharegptInstructionHandler,
        PreferencePairwiseHandler,
        HHRLHFPairwiseHandler,
        RMStaticPairwiseHandler,
        AlpacaStylePairwiseHandler,
        SharegptStylePairwiseHandler,
    )
}
ALIASES: dict[str, str] = {
    "pretrain": "GeneralPretrainHandler",
    "alpaca": "GeneralInstructionHandler",
    "belle": "BelleMultiTurnInstructionHandler",
    "moss": "MOSSInstructionHandler",
    "leetcode": "LeetcodePythonInstructionHandler",
    "sharegpt": "SharegptInstructionHandler",
    "preference": "PreferencePairwiseHandler",
    "hh": "HHRLHFPairwiseHandler",
    "rm-static": "RMStaticPairwiseHandler",
    "alpaca_pairwise": "AlpacaStylePairwiseHandler",
    "sharegpt_pairwise": "SharegptStylePairwiseHandler",
}


def handler_choices() -> list[str]:
    """Every accepted `--handler-name` (class names, then short aliases)."""
    return [*HANDLERS, *ALIASES]


def get_handler_class(name: str) -> type[Handler]:
    """Resolve a registry name, alias or `module:Class` (ValueError naming the choices)."""
    if name in HANDLERS:
        return HANDLERS[name]
    if name in ALIASES:
        return HANDLERS[ALIASES[name]]
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"--handler-name {name!r}: cannot import module {module_name!r} ({exc}); "
                "make it importable (PYTHONPATH) or fix the name"
            ) from exc
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            raise ValueError(
                f"--handler-name {name!r}: {module_name} has no Handler subclass {class_name!r}; "
                "subclass services.preprocess.handlers.Handler"
            )
        return cls
    raise ValueError(
        f"--handler-name {name!r} is unknown; choose one of {handler_choices()} or pass module:Class"
    )


__all__ = [
    "ALIASES",
    "HANDLERS",
    "IGNORE_INDEX",
    "INSTRUCTION_KEYS",
    "PAIRWISE_KEYS",
    "BelleMultiTurnInstructionHandler",
    "GeneralInstructionHandler",
    "GeneralPretrainHandler",
    "Handler",
    "HandlerOptions",
    "LeetcodePythonInstructionHandler",
    "MOSSInstructionHandler",
    "RecordError",
    "Sample",
    "SharegptInstructionHandler",
    "get_handler_class",
    "handler_choices",
]
