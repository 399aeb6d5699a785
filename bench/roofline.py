"""Decode at the bandwidth limit: the batch-1 roofline of a Llama-shaped model, and its report.

A batch-1 decode step reads every weight it multiplies by once (each layer's q, k, v, o, gate,
up, down and norms, the final norm and the output head; the embedding is only gathered, one
row) and the KV cache of every earlier position. With W the weight bytes and b bytes per
element:

    bytes/token  = W + 2 · L · n_kv · d_head · b · ctx      (K and V, every layer, ctx positions)
    ctx          = prompt + new / 2                          (mean over `new` decoded tokens)
    roofline     = bytes/token / BW                          (seconds per token at bandwidth BW)
    fraction     = roofline / measured seconds per token    (issue #43's target: >= 0.80)

BW is the device's copy bandwidth measured in the same run (2 x bytes copied / time), as the
issue asks; the vendor's figure (H100 SXM 3.35 TB/s, H200 4.8 TB/s) is printed beside it.
"""

from __future__ import annotations

import math
from typing import Any

LLAMA_8B = dict(
    hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, prompt=128, new=128,
)  # fmt: skip
"""Llama-3-8B's shape (8,030,261,248 parameters, untied output head)."""
TARGET_FRACTION = 0.80
"""Issue #43: batch-1 decode at >= 80% of the roofline."""
TARGET_SERVED_RATIO = 0.95
"""Issue #43: served (gRPC, HTTP) time per token within 5% of in-process."""
VENDOR_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
"""Published HBM bandwidth in bytes/s by device-name substring (SXM parts)."""


def weight_bytes(shape: dict[str, int], element_bytes: int) -> int:
    """Bytes of the weights one decode step streams: all but the embedding (untied head)."""
    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    attention = hidden * head_dim * (2 * shape["heads"] + 2 * shape["kv"])  # q, o; k, v
    mlp = 3 * hidden * shape["ffn"]  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # + the two RMSNorm weights
    return (shape["layers"] * per_layer + hidden + shape["vocab"] * hidden) * element_bytes


def kv_bytes(shape: dict[str, int], context: float, element_bytes: int) -> float:
    """Bytes of K and V a decode step reads over `context` cached positions."""
    head_dim = shape["hidden"] // shape["heads"]
    return 2 * shape["layers"] * shape["kv"] * head_dim * element_bytes * context


def mean_context(shape: dict[str, int]) -> float:
    """Mean cached positions over the decoded tokens: prompt + new / 2."""
    return shape["prompt"] + shape["new"] / 2


def vendor_bandwidth(device_name: str) -> float | None:
    """The published bandwidth of `device_name` (None: not in VENDOR_BANDWIDTH)."""
    return next((bw for key, bw in VENDOR_BANDWIDTH.items() if key in device_name), None)


def roofline(
    shape: dict[str, int], element_bytes: int, bandwidth: float, measured_s: float
) -> dict[str, Any]:
    """The batch-1 bound and the fraction of it `measured_s` (seconds per token) reaches."""
    weights = weight_bytes(shape, element_bytes)
    kv = kv_bytes(shape, mean_context(shape), element_bytes)
    bound = (weights + kv) / bandwidth
    return {
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bytes_per_token": weights + kv,
        "bandwidth_bytes_s": bandwidth,
        "roofline_ms": bound * 1e3,
        "measured_ms": measured_s * 1e3,
        "fraction": bound / measured_s,
        "formula": (
            f"({weights / 1e9:.3f} GB weights + 2·{shape['layers']}·{shape['kv']}·"
            f"{shape['hidden'] // shape['heads']}·{element_bytes} B·{mean_context(shape):g} "
            f"positions = {kv / 1e9:.4f} GB KV) / {bandwidth / 1e12:.3f} TB/s = "
            f"{bound * 1e3:.3f} ms/token; measured {measured_s * 1e3:.3f} ms/token -> "
            f"{bound / measured_s:.1%}"
        ),
    }


def verdict(mode: str, value: float | None, target: float) -> str:
    """ "met"/"not met" against `target` on a GPU run; "open" otherwise (a smoke run on a CPU
    measures the logic, not the device: issue #43 leaves those rows open)."""
    if mode != "gpu" or value is None or math.isnan(value):
        return "open (no GPU measurement)"
    return "met" if value >= target else "not met"


def markdown(result: dict[str, Any], mode: str) -> list[str]:
    """The roofline phase's lines of the device-check report (what was measured, when a run
    was cut short)."""
    if "error" in result:
        return ["", f"Decode roofline: {result['error']}"]
    lines = ["", f"Decode roofline ({result['dtype']}, shape {result['shape']}):", ""]
    if "incomplete" in result:
        lines.append(f"- cut short ({result['incomplete']}): the steps below are what it measured")
    bw = result.get("bandwidth")
    if bw:
        vendor = bw.get("vendor_bytes_s")
        lines.append(
            f"- memory bandwidth measured by device copies: {bw['measured_bytes_s'] / 1e12:.3f} TB/s"
            + (f" ({bw['measured_bytes_s'] / vendor:.0%} of the vendor's {vendor / 1e12:.2f})"
               if vendor else "")
        )  # fmt: skip
    batch1 = result.get("batch1")
    if batch1:
        state = verdict(mode, batch1["fraction"], TARGET_FRACTION)
        lines.append(
            f"- batch 1 in-process: {batch1['formula']} — target >= {TARGET_FRACTION:.0%}: {state}"
        )
    if result.get("batches"):
        lines += [
            "",
            "| decode batch | tokens/s (prefill excluded) | ms per step |",
            "|---|---|---|",
        ]
        for row in result["batches"]:
            lines.append(f"| {row['rows']} | {row['tokens_per_s']:,.0f} | {row['step_ms']:.2f} |")
    served = result.get("served", {})
    if "error" in served:
        lines += ["", f"Served: {served['error']}"]
    elif served and batch1:
        lines += ["", "| batch 1 | ms/token | in-process / served |", "|---|---|---|"]
        lines.append(f"| in-process | {batch1['measured_ms']:.3f} | 1.000 |")
        for name in ("grpc", "http"):
            row = served.get(name, {})
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | |")
            elif row:
                state = verdict(mode, row["ratio"], TARGET_SERVED_RATIO)
                lines.append(f"| {name} | {row['ms']:.3f} | {row['ratio']:.3f} ({state}) |")
    loadgen = result.get("loadgen")
    if loadgen:
        lines += ["", str(loadgen.get("error") or loadgen["markdown"]).rstrip()]
    return lines
