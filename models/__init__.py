"""Architectures (one generic decoder for every family, dense or MoE), config registry, adapters.

`build_model(config)` is the one model builder: it returns a `CausalLM` for any `ModelConfig`,
with MoE layers when `config.moe` (a `MoEConfig`) is set; `models.registry.get_config(name)`
returns the named configs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.config import ModelConfig
from models.moe_config import MoEConfig

if TYPE_CHECKING:
    from models.transformer import CausalLM, build_model

__all__ = ["CausalLM", "MoEConfig", "ModelConfig", "build_model"]

_HEAVY = ("CausalLM", "build_model")


def __getattr__(name: str) -> Any:
    # Lazy so that light users (the config registry, `meshline estimate`) skip the kernel imports.
    if name in _HEAVY:
        from models import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
