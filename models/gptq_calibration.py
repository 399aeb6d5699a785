"""Sequential GPTQ calibration of a decoder, one unit at a time (as `meshline convert` streams it).

Legend: N calibration samples, S tokens each, E hidden size.

The calibration tokens' hidden states [N, S, E] are the only state carried between units:

- the embedding unit turns the token ids into the first layer's inputs (with the embedding
  rounded as the checkpoint will store it, when it is quantized);
- each decoder layer is built alone from its unit's tensors (float32), run once over the hidden
  states with a hook on every `nn.Linear` accumulating that projection's input Hessian, then
  every projection is rounded by `kernels.gptq.gptq_quantize`, the layer's weights are replaced
  by the rounded ones, and the layer is run again: its outputs, computed with the quantized
  layer, are the next layer's inputs (the paper's sequential scheme; within a layer all
  projections see the float layer's inputs).

Memory: the hidden states (N·S·E·4 bytes, twice while a layer runs) plus one layer in float32
and one I×I Hessian per projection (float64).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.gptq import GptqSettings, HessianAccumulator, gptq_quantize
from kernels.quantization import QuantizedWeight, WeightScheme, dequantize_weight, quantize_weight
from models.config import ModelConfig
from models.transformer import build_model

EMBEDDING_PARTS = ("embed_tokens", "embed_positions", "embed_layernorm")
"""The modules of the embedding unit."""


def check_calibratable(config: ModelConfig) -> None:
    """ValueError when a decoder layer holds a 2-D weight that is not an `nn.Linear`'s (GPTQ
    rounds Linear layers from their inputs; the checkpoint would quantize that weight too)."""
    layer = build_model(config, device="meta").layers["0"] if config.num_layers else None
    if layer is None:
        return
    owners = {f"{path}.weight" for path, m in layer.named_modules() if isinstance(m, nn.Linear)}
    others = sorted(
        name
        for name, p in layer.named_parameters()
        if p.dim() == 2 and name.endswith(".weight") and name not in owners
    )
    if others:
        raise ValueError(
            f"--quantize-method gptq rounds Linear layers only; the model's layers also hold "
            f"{others}; use --quantize-method rtn for this model"
        )


class GptqCalibrator:
    """Carries calibration hidden states through the units and rounds each layer with GPTQ."""

    def __init__(
        self,
        config: ModelConfig,
        tokens_NS: torch.Tensor,
        weights: WeightScheme,
        settings: GptqSettings,
        embedding: WeightScheme | None = None,
        batch_rows: int = 4,
    ) -> None:
        if tokens_NS.dim() != 2 or tokens_NS.shape[1] < 1:
            raise ValueError(f"calibration tokens must be [samples, length], got {tokens_NS.shape}")
        self.config = config
        self.weights = weights
        """The layers' scheme."""
        self.settings = settings
        """GPTQ's own settings."""
        self.embedding = embedding
        """How the embedding is stored (None: kept as it is)."""
        self.batch_rows = batch_rows
        """Samples per forward (bounds the activations of one layer's forward)."""
        self.tokens_NS = tokens_NS.long()
        self.model = build_model(config, device="meta")
        n, s = self.tokens_NS.shape
        self.positions_NS = torch.arange(s).expand(n, s)
        self.hidden_NSE: torch.Tensor | None = None

    def embed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Computes the first layer's inputs from the embedding unit's tensors."""
        for part in EMBEDDING_PARTS:
            module = getattr(self.model, part)
            if module is None:
                continue
            state = _strip(tensors, f"{part}.")
            if part == "embed_tokens" and self.embedding is not None:
                q = quantize_weight(state["weight"].float(), self.embedding)
                state["weight"] = dequantize_weight(q)
            _materialise(module, state)
        with torch.no_grad():
            h_NSE = self.model.embed_tokens(self.tokens_NS)
            if self.model.embed_positions is not None:
                h_NSE = h_NSE + self.model.embed_positions(self.positions_NS)
            if self.model.embed_layernorm is not None:
                h_NSE = self.model.embed_layernorm(h_NSE)
        self.hidden_NSE = h_NSE.float()
        for part in EMBEDDING_PARTS:
            if getattr(self.model, part) is not None:
                getattr(self.model, part).to("meta")

    def quantize_layer(
        self, index: int, tensors: dict[str, torch.Tensor], quantized: set[str]
    ) -> dict[str, QuantizedWeight]:
        """GPTQ codes of layer `index`'s `quantized` weights (Meshline names; each an
        `nn.Linear`'s), and the next layer's inputs computed with them."""
        if self.hidden_NSE is None:
            raise RuntimeError("GptqCalibrator.quantize_layer before embed")
        prefix = f"layers.{index}."
        layer = self.model.layers[str(index)]
        _materialise(layer, _strip(tensors, prefix))
        linears = {
            f"{prefix}{path}.weight": module
            for path, module in layer.named_modules()
            if isinstance(module, nn.Linear) and f"{prefix}{path}.weight" in quantized
        }
        missing = sorted(quantized - set(linears))
        if missing:
            raise ValueError(
                f"GPTQ rounds Linear layers only; {missing} are not nn.Linear weights of "
                "the model (use --quantize-method rtn for this model)"
            )
        hessians = {name: HessianAccumulator(m.in_features) for name, m in linears.items()}
        hooks = [
            module.register_forward_pre_hook(_accumulate(hessians[name]))
            for name, module in linears.items()
        ]
        try:
            self._run(layer, keep=False)
        finally:
            for hook in hooks:
                hook.remove()
        result: dict[str, QuantizedWeight] = {}
        for name, module in linears.items():
            q = gptq_quantize(module.weight, hessians[name].hessian, self.weights, self.settings)
            del hessians[name]
            with torch.no_grad():
                module.weight.copy_(dequantize_weight(q))
            result[name] = q
        self._run(layer, keep=True)
        layer.to("meta")
        return result

    def _run(self, layer: nn.Module, keep: bool) -> None:
        """Runs `layer` over the hidden states in batches; `keep` replaces them by its outputs."""
        assert self.hidden_NSE is not None
        rotary = self.model.rotary
        outputs = []
        with torch.no_grad():
            for start in range(0, self.hidden_NSE.shape[0], self.batch_rows):
                h_BSE = self.hidden_NSE[start : start + self.batch_rows]
                positions_BS = self.positions_NS[start : start + self.batch_rows]
                rope = rotary(positions_BS) if rotary is not None else None
                out_BSE = layer(h_BSE, rope)
                if keep:
                    outputs.append(out_BSE.float())
        if keep:
            self.hidden_NSE = torch.cat(outputs)


def _accumulate(accumulator: HessianAccumulator):
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        accumulator.add(args[0])

    return hook


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, renamed relative to it, in float32."""
    return {n.removeprefix(prefix): t.float() for n, t in tensors.items() if n.startswith(prefix)}


def _materialise(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Gives a meta module CPU float32 storage holding exactly `state` (strict)."""
    module.to_empty(device="cpu")
    module.float()
    module.load_state_dict(state, strict=True)
    module.eval()
