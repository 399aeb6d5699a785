"""Loss scaling for fp16: a constant scale, or a dynamic one that backs off on overflow.

The dynamic rules are Megatron's `DynamicGradScaler` (compared with megatron-core in the tests):
an overflow resets the growth count and spends one unit of hysteresis; when hysteresis runs out
the scale is multiplied by the backoff factor (never below the minimum). After `window`
consecutive clean steps the scale grows by the growth factor and hysteresis is refilled.
bf16 and fp32 use `NoLossScaler` (scale 1; overflow still skips the step).
"""

from __future__ import annotations

from typing import Any

from training.run_sections import PrecisionSection


class NoLossScaler:
    """Scale 1.0 that never changes."""

    def __init__(self, scale: float = 1.0) -> None:
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped by the caller)."""
        del found_inf

    def state_dict(self) -> dict[str, Any]:
        """Plain values only."""
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self._scale = float(state["scale"])


class DynamicLossScaler(NoLossScaler):
    """Megatron-style dynamic loss scale with growth window and hysteresis."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        window: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not (initial_scale >= min_scale > 0):
            raise ValueError(
                f"need --initial-loss-scale ({initial_scale}) >= --min-loss-scale ({min_scale}) > 0"
            )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("the growth factor must be > 1 and the backoff factor in (0, 1)")
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.window, self.hysteresis = window, hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.window:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Plain values only."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(precision: PrecisionSection) -> NoLossScaler:
    """fp16: constant (--loss-scale) or dynamic scaler; bf16/fp32: scale 1."""
    if not precision.fp16:
        return NoLossScaler(1.0)
    if precision.loss_scale is not None:
        return NoLossScaler(precision.loss_scale)
    return DynamicLossScaler(
        precision.initial_loss_scale,
        precision.min_loss_scale,
        window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )
