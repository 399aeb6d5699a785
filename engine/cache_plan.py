"""How big the KV cache of one engine is: rows x max model length inside a memory budget.

The budget is --kv-cache-memory when given; on an accelerator otherwise the share
--gpu-memory-utilization (vLLM's default 0.9) of the device's total memory less what is in use
once the weights are loaded (measured, as vLLM measures it); on CPU otherwise
`DEFAULT_CPU_KV_CACHE_MEMORY`. The dense cache holds `rows` rows of `max_model_len` slots, so
the rows are the budget over one row's bytes, at most --max-batch-rows; a budget that cannot
hold one row is refused, naming the flags that would fix it. (With paged KV the same budget
becomes a block count.) `CachePlan.summary` is the one line the server logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    format_size,
)
from engine.quantized_model import weight_bytes
from engine.slots import local_kv_heads
from models.transformer import CausalLM


@dataclass(frozen=True)
class CachePlan:
    """The KV cache an engine allocates and why."""

    rows: int
    """Cache rows (sequences decoded together)."""
    max_model_len: int
    """Tokens per row: prompt + new tokens of one sequence."""
    bytes_per_row: int
    """Bytes of one row over every layer this process holds (keys, values, mask)."""
    budget: int
    """Bytes the cache may take."""
    summary: str
    """One line: what is reserved and why (the server logs it)."""
    blocks: int = 0
    """Paged cache: blocks of `block_size` token slots (0: dense rows)."""
    block_size: int = 0
    """Paged cache: token slots per block."""


def row_bytes(model: CausalLM, max_model_len: int) -> int:
    """Bytes of one cache row of `max_model_len` tokens for the layers (and KV-head shard) this
    process holds, as `models.kv_cache.KVCache` allocates it (a sliding window's ring rows hold
    the window)."""
    config = model.config
    window = config.sliding_window
    slots = max_model_len if window is None else min(window, max_model_len)
    itemsize = next(model.parameters()).element_size()
    per_slot = len(model.layers) * 2 * local_kv_heads(model) * config.head_dim * itemsize
    return slots * (per_slot + 1)  # + the bool key mask


def _device_budget(config: EngineConfig, device: torch.device, weights: str) -> tuple[int, str]:
    """(bytes, why) when no --kv-cache-memory is given."""
    util = config.gpu_memory_utilization
    if device.type == "cpu":
        if util is not None:
            raise ValueError(
                "--gpu-memory-utilization is a share of an accelerator's memory; on CPU give "
                "--kv-cache-memory (bytes, e.g. 2GiB)"
            )
        return DEFAULT_CPU_KV_CACHE_MEMORY, "the CPU default; --kv-cache-memory sets it"
    backend = getattr(torch, device.type, None)
    mem_get_info = getattr(backend, "mem_get_info", None)
    if mem_get_info is None:
        raise ValueError(
            f"{device.type}: this device reports no free memory; give --kv-cache-memory (bytes)"
        )
    free, total = mem_get_info(device)
    util = DEFAULT_GPU_MEMORY_UTILIZATION if util is None else util
    used = total - free
    budget = int(util * total) - used
    why = (
        f"--gpu-memory-utilization {util:g} of {format_size(total)} less "
        f"{format_size(used)} in use after loading {weights}"
    )
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {why}; raise --gpu-memory-utilization or give "
            "--kv-cache-memory"
        )
    return budget, why


def plan_cache(
    model: CausalLM,
    config: EngineConfig,
    context_length: int,
    device: torch.device,
    *,
    paged: bool = False,
) -> CachePlan:
    """The cache `config` allows for `model` (ValueError naming the flag when none fits):
    dense rows, or with `paged` blocks of --block-size slots, as many as the budget holds up
    to what --max-batch-rows full-length rows would take (rows then cost no memory; requests
    wait for blocks instead)."""
    if config.max_model_len is not None and config.max_model_len > context_length:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's context length "
            f"{context_length}; give at most {context_length} or leave it out"
        )
    max_len = config.max_model_len or context_length
    len_why = "--max-model-len" if config.max_model_len else "the model's context length"
    per_row = row_bytes(model, max_len)
    weights = format_size(weight_bytes(model))
    if config.kv_cache_memory is not None:
        budget, why = config.kv_cache_memory, "--kv-cache-memory"
    else:
        budget, why = _device_budget(config, device, f"{weights} of weights")
    fit = budget // per_row
    if fit < 1:
        raise ValueError(
            f"the KV cache budget {format_size(budget)} ({why}) holds no row of "
            f"{max_len} tokens ({format_size(per_row)} a row); lower --max-model-len "
            f"(at most {max(budget // max(per_row // max_len, 1), 0)} tokens fit) or raise "
            "--kv-cache-memory"
        )
    if paged:
        return _paged_plan(model, config, max_len, len_why, per_row, budget, why, weights)
    rows = min(fit, config.max_batch_rows)
    rows_why = (
        "--max-batch-rows" if rows == config.max_batch_rows else "as many as the budget holds"
    )
    cfg = model.config
    summary = (
        f"KV cache: {rows} row{'s' if rows != 1 else ''} ({rows_why}) x {max_len} tokens ({len_why}) = "
        f"{format_size(rows * per_row)} reserved, {format_size(per_row)} a row "
        f"({len(model.layers)} layers x K,V x {local_kv_heads(model)} KV heads x "
        f"{cfg.head_dim} x {next(model.parameters()).dtype} a token); budget "
        f"{format_size(budget)} ({why}); weights {weights}"
    )
    return CachePlan(rows, max_len, per_row, budget, summary)


def _paged_plan(
    model: CausalLM,
    config: EngineConfig,
    max_len: int,
    len_why: str,
    per_row: int,
    budget: int,
    why: str,
    weights: str,
) -> CachePlan:
    size = config.block_size
    per_block = (per_row - max_len) // max_len * size  # a slot's keys and values, no mask
    per_seq = -(-max_len // size)
    blocks = min(budget // per_block, config.max_batch_rows * per_seq)
    blocks_why = (
        "--max-batch-rows full-length rows"
        if blocks == config.max_batch_rows * per_seq
        else "as many as the budget holds"
    )
    summary = (
        f"KV cache: paged, {blocks} blocks of {size} tokens ({blocks_why}) = "
        f"{format_size(blocks * per_block)} reserved, {format_size(per_block)} a block; up to "
        f"{config.max_batch_rows} rows (--max-batch-rows) of up to {max_len} tokens ({len_why}); "
        f"budget {format_size(budget)} ({why}); weights {weights}"
    )
    return CachePlan(config.max_batch_rows, max_len, per_row, budget, summary, blocks, size)
