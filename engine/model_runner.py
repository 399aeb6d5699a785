"""The model runner: everything about running the model for an engine, nothing about requests.

It owns the model and the KV-cache pool and decides, once at start, how the model runs: the CPU
weight layout (`--cpu-linear`, engine/linear_choice.py), the one-token decode path (the module
forward, the lean `DecodeStep`, one C call per step `NativeStep`, or the torch.compile'd
forward), CUDA graphs of the lean step, and the cache's size (engine/cache_plan.py). The engine's
scheduler (engine/scheduler.py) decides which requests run; the engine asks the runner for logits.

The decode path is chosen from the configuration and from what the model and this build can do
(each builder logs why it declines), and from one explicit capability of the caller:
`own_forward`, set by an engine whose forward is not the model's (a pipeline stage sends hidden
states between processes), which keeps every fast path off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.cache_plan import CachePlan, plan_cache
from engine.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from engine.cuda_graphs import GraphedDecode
from engine.decode_step import DecodeStep
from engine.linear_choice import choose_cpu_linear, to_column_major
from engine.native_step import C_ROWS, MAX_ROWS, NativeStep
from engine.paged_pool import PagedPool, Prefill
from engine.slots import SlotPool
from kernels import registry
from kernels.cpu.hugepages import move_to_huge_pages
from kernels.packed_linear import pack_linears
from models.kv_cache import KVCache
from models.lora_batched import BatchedLora, find_targets
from models.transformer import CausalLM

log = logging.getLogger(__name__)
Forward = Callable[[torch.Tensor, KVCache], torch.Tensor]
"""Logits [B, V] of each row's last position, given ids [B, S] and a cache view."""


def _same_rows(rows: int, device: torch.device) -> int:
    return rows


class ModelRunner:
    """Runs one model's forwards over a pre-allocated KV-cache pool."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        *,
        own_forward: bool = False,
        agree_rows: Callable[[int, torch.device], int] = _same_rows,
        pages_kv: bool = True,
    ) -> None:
        self.model = model.eval()
        self.config = config
        self.own_forward = own_forward
        """The engine runs its own forward (a pipeline stage): the module path only."""
        # max_position_embeddings, longer under dynamic RoPE scaling (ModelConfig.context_length)
        self.context_length = int(
            getattr(model.config, "context_length", model.config.max_position_embeddings)
        )
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # before any layout or step takes views of the weights
            log.info("weights: %s", move_to_huge_pages(model).why)
        if config.compile_decode and self.device.type != "cpu":
            raise ValueError(
                f"--compile-decode is for CPU serving (inductor's C++ backend); the model is on "
                f"{self.device.type}"
            )
        not_paged = self._why_not_paged(pages_kv)
        self.paged = not_paged is None
        """Whether the KV cache is paged (blocks, prefix caching, chunked prefill)."""
        self.prefix_caching = self.paged and config.enable_prefix_caching is not False
        """Whether full blocks are shared between requests (--enable-prefix-caching)."""
        self.chunked_prefill = self.paged and config.enable_chunked_prefill is not False
        """Whether long prompts prefill in chunks within a step budget."""
        self.max_num_batched_tokens = (
            (config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
            if self.chunked_prefill
            else None
        )
        """Tokens one step computes at most (chunked prefill), or None: no budget."""
        if not_paged is not None:
            log.info("KV cache: dense rows, not paged (%s)", not_paged)
        self.cache_plan: CachePlan = plan_cache(
            model, config, self.context_length, self.device, paged=self.paged
        )
        """The KV cache's size and why (engine.cache_plan); its summary is logged once."""
        log.info("%s", self.cache_plan.summary)
        self.max_model_len = self.cache_plan.max_model_len
        """Tokens per sequence, prompt + new (--max-model-len)."""
        self.pool: SlotPool | PagedPool
        if self.paged:
            self.pool = PagedPool(
                model,
                self.cache_plan.rows,
                self.max_model_len,
                self.cache_plan.blocks,
                self.cache_plan.block_size,
                prefix_caching=self.prefix_caching,
            )
        else:
            self.pool = SlotPool(
                model, agree_rows(self.cache_plan.rows, self.device), self.max_model_len
            )
        self.lora = self._lora_slots()
        """Adapter slots in the model's projections (--enable-lora), or None."""
        self.cpu_linear = self._apply_layout()
        """The layout in use ("auto" resolved to "dense", "packed", "colmajor" or
        "packed+gemv")."""
        # The decode forward (one token per row) captured by torch.compile, or None (eager).
        if config.compile_decode:
            registry.preload()  # backend choices made eagerly, outside the traced graph
        self.compiled_model: Any = torch.compile(model) if config.compile_decode else None
        self.decode_step = self._build_decode_step()
        """The lean or C decode step, or None: the module (or compiled) forward."""
        self.graphs = self._build_graphs()
        """CUDA graphs of the lean step, or None: eager steps."""
        if self.lora is not None:  # after the fast paths, which read the plain layers
            self.lora.attach(model)

    def _lora_slots(self) -> BatchedLora | None:
        """--enable-lora: slots for --max-loras adapters of rank --max-lora-rank in every
        decoder-layer projection (found before the layout replaces any layer)."""
        if not self.config.enable_lora:
            return None
        if self.own_forward:
            raise ValueError("--enable-lora: LoRA adapters are not served by a pipeline stage")
        targets = find_targets(self.model)
        if not targets:
            raise ValueError("--enable-lora: the model has no plain linear projections to adapt")
        dtype = next(self.model.parameters()).dtype
        lora = BatchedLora(
            targets, self.config.max_loras, self.config.max_lora_rank, self.device, dtype
        )
        log.info(
            "LoRA: %d adapter slot(s) of rank %d on %d layers (%.1f MiB)",
            lora.slots,
            lora.max_rank,
            len(targets),
            lora.nbytes() / 2**20,
        )
        return lora

    def _why_not_paged(self, pages_kv: bool) -> str | None:
        """Why this engine keeps dense cache rows, or None: its cache is paged. Asking for
        prefix caching or chunked prefill where it is not is refused, naming the flag."""
        config = self.config
        why = None
        if self.own_forward:
            why = "tensor- and pipeline-parallel engines keep dense rows"
        elif not pages_kv:
            why = "this engine keeps dense rows (tensor-parallel ranks, colocated rollouts)"
        elif self.model.config.sliding_window is not None:
            why = "a sliding-window model keeps ring rows (memory bounded by its window)"
        elif config.compile_decode:
            why = "--compile-decode traces the dense cache's attention op"
        elif self.device.type != "cpu" and not config.enforce_eager:
            why = "CUDA graphs replay dense rows (engine/cuda_graphs.py); --enforce-eager pages"
        if why is None:
            return None
        for flag, value in (
            ("--enable-prefix-caching", config.enable_prefix_caching),
            ("--enable-chunked-prefill", config.enable_chunked_prefill),
            ("--max-num-batched-tokens", config.max_num_batched_tokens),
            # Another block size than the default is a request for blocks, as the flags above.
            (
                "--block-size",
                None if config.block_size == DEFAULT_BLOCK_SIZE else config.block_size,
            ),
        ):
            if value is not None and value is not False:
                raise ValueError(f"{flag} needs the paged KV cache, which this engine lacks: {why}")
        return why

    def _apply_layout(self) -> str:
        model = self.model
        shared_head = model.config.tie_word_embeddings or model.config.norm_head
        skip = ("lm_head",) if shared_head else ()
        layout = self.config.cpu_linear
        if layout == "auto":
            on_cpu = self.device.type == "cpu"
            # Steps of up to C_ROWS rows in C read row-major weights: the layout runs the rest.
            c_rows = C_ROWS if on_cpu and self._native_planned() else 0
            layout = choose_cpu_linear(model, skip, c_rows=c_rows) if on_cpu else "dense"
        if layout == "colmajor":
            to_column_major(model, skip)
            log.info("column-major weights: %s", move_to_huge_pages(model).why)
        elif layout != "dense":
            pack_linears(model, skip, gemv_copy=layout == "packed+gemv")
        return layout

    def _build_decode_step(self) -> DecodeStep | NativeStep | None:
        """The lean decode step, with steps in C where that applies (see
        EngineConfig.decode_step), or None: the module forward."""
        if self.config.decode_step == "module" or self.compiled_model is not None:
            return None
        if self.own_forward:
            return None
        step, why = DecodeStep.build(self.model)
        log.info("decode step: %s (%s)", "lean" if step is not None else "module forward", why)
        if step is None or self.config.decode_step != "auto" or self.device.type != "cpu":
            return step
        native, why = NativeStep.build(step)
        if native is not None and self.cpu_linear == "dense" and native.max_rows == C_ROWS:
            # C_ROWS bounds C steps where a packed layout runs larger ones faster; with dense
            # weights the lean step's product is MKL's over the same row-major weights, which
            # the C step matched or beat at 32 and 64 rows (hidden 128 and 512, fp32; the
            # colocated rollouts of bench/bench_rollouts.py run there).
            native.max_rows = MAX_ROWS
        log.info(
            "decode steps in C: %s (%s)",
            f"up to {native.max_rows} row(s)" if native else "none, the lean step",
            why,
        )
        return native or step

    def _native_planned(self) -> bool:
        """Whether steps will run in C (engine.native_step) with the weights as loaded: decided
        before the linear layout, which must then keep row-major weights."""
        if self.config.decode_step != "auto" or self.config.compile_decode or self.own_forward:
            return False
        lean, _ = DecodeStep.build(self.model)
        native, _ = NativeStep.build(lean)
        return native is not None

    def _build_graphs(self) -> GraphedDecode | None:
        """CUDA graphs of the lean decode step, or None (eager steps)."""
        if not isinstance(self.decode_step, DecodeStep):  # none, or the C step (CPU only)
            return None
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not isinstance(self.pool, SlotPool):
            return None  # paged: declined in _why_not_paged unless --enforce-eager
        if self.pool.cache.is_ring:
            log.info("decode: eager steps (sliding-window rings are not graphed)")
            return None
        return GraphedDecode(self.decode_step, self.pool.cache)

    def decode(
        self,
        ids_B1: torch.Tensor,
        start: int,
        stop: int,
        forward: Forward,
        compiled: bool = False,
        adapters_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of pool rows [start, stop) fed `ids_B1`: the CUDA graphs for all active
        rows, the lean or C step, the compiled forward (when `compiled`), else `forward`.
        `adapters_B`, each row's LoRA slot (None: no row has one), runs `forward` (the module
        forward, which the adapters hook) with those deltas: the fast paths know no LoRA."""
        if adapters_B is not None:
            assert self.lora is not None
            view = self.pool.view(start, stop)
            with self.lora.rows(adapters_B):
                logits_BV = forward(ids_B1, view)
            self.pool.sync(view, start)
            return logits_BV
        if self.graphs is not None and compiled and start == 0 and stop == self.pool.num_rows:
            # Every active row at once, from a CUDA graph (it commits the rows itself).
            assert isinstance(self.pool, SlotPool)
            return self.graphs(ids_B1, self.pool.lengths())
        view = self.pool.view(start, stop)
        if self.decode_step is not None:
            step = view.begin(1, None)
            logits_BV = self.decode_step(ids_B1, view, step)
            view.commit(step)
        elif self.compiled_model is None or not compiled:
            logits_BV = forward(ids_B1, view)
        else:
            # The cache's host-side planning (begin/commit) stays outside the compiled graph.
            step = view.begin(1, None)
            logits_BV = self.compiled_model(
                ids_B1, kv_cache=view, cache_step=step, logits_to_keep=1
            )[:, -1]
            view.commit(step)
        self.pool.sync(view, start)  # type: ignore[arg-type]
        return logits_BV

    def prefill(
        self,
        prompts: list[list[int]],
        start: int,
        forward: Forward,
        adapters_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First-token logits of same-length prompts prefilled together from pool row `start`
        (row b with LoRA slot `adapters_B[b]`; None: no adapter)."""
        view = self.pool.view(start, start + len(prompts))
        ids_BS = torch.tensor(prompts, device=self.device)
        if adapters_B is None:
            logits = forward(ids_BS, view)
        else:
            assert self.lora is not None
            with self.lora.rows(adapters_B):
                logits = forward(ids_BS, view)
        self.pool.sync(view, start)  # type: ignore[arg-type]
        return logits

    def prefill_chunk(
        self,
        prefills: list[Prefill],
        tokens: int,
        forward: Forward,
        adapters_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of the last of the next `tokens` prompt tokens of prefills at the same
        length, written into their block tables (the paged cache); row b with LoRA slot
        `adapters_B[b]` (None: no adapter)."""
        assert isinstance(self.pool, PagedPool)
        view = self.pool.prefill_view(prefills)
        ids_BS = torch.tensor(
            [f.tokens[f.done : f.done + tokens] for f in prefills], device=self.device
        )
        if len(prefills) == 1 and adapters_B is None and isinstance(self.decode_step, NativeStep):
            # A chunk of a few tokens (a small step budget beside decoding rows) in one C call
            # that reads the blocks in place: the module forward gathers every key and value of
            # the context per layer, a fixed cost that made a 4-token chunk cost ~2 decode steps
            # at 2k tokens of context (bench/RESULTS.md, #39). None beyond the C step's rows.
            logits_SV = self.decode_step.verify(ids_BS[0], view)
            if logits_SV is not None:
                self.pool.prefilled(prefills[0], tokens)
                return logits_SV[-1:]
        if adapters_B is None:
            logits = forward(ids_BS, view)
        else:
            assert self.lora is not None
            with self.lora.rows(adapters_B):
                logits = forward(ids_BS, view)
        for prefill in prefills:
            self.pool.prefilled(prefill, tokens)
        return logits

    def resize_cache(self, rows: int, max_seq_len: int) -> None:
        """Replace the dense KV-cache pool, which must hold no row, by one of `rows` rows of
        `max_seq_len` slots (colocated rollouts release it between calls for training)."""
        if not isinstance(self.pool, SlotPool) or self.graphs is not None:
            raise ValueError(
                "ModelRunner.resize_cache: only a dense pool without CUDA graphs is resized (a "
                "paged pool's block tables and captured graphs hold the old buffers)"
            )
        if self.pool.num_rows:
            raise RuntimeError(f"ModelRunner.resize_cache: {self.pool.num_rows} rows in use")
        if rows <= 0 or not 0 < max_seq_len <= self.max_model_len:
            raise ValueError(
                f"ModelRunner.resize_cache: {rows} rows of {max_seq_len} slots (rows > 0, "
                f"slots in 1..{self.max_model_len})"
            )
        self.pool = SlotPool(self.model, rows, max_seq_len)

    def row_length(self, row: int) -> int:
        """Tokens cached in active pool row `row` (speculative decoding's `TargetRows`)."""
        return self.pool.lengths()[row]

    def decode_one(self, row: int, token: int, adapter: int = 0) -> torch.Tensor:
        """Logits [1, V] after feeding `token` to pool row `row` alone (the lean or C step; the
        module forward with LoRA slot `adapter`'s delta when it is not 0)."""
        ids_11 = torch.tensor([[token]], device=self.device)
        adapters_B = torch.tensor([adapter], device=self.device) if adapter else None
        return self.decode(ids_11, row, row + 1, self.last_logits, adapters_B=adapters_B)

    def forward_tokens(self, row: int, ids: list[int], adapter: int = 0) -> torch.Tensor:
        """Logits [S, V] of every position after feeding `ids` to pool row `row` at its length:
        in one C call where the C step runs and S fits its rows (`NativeStep.verify`), else the
        module forward (the lean step takes one token per row), which alone adds LoRA slot
        `adapter`'s delta (not 0: the C step knows no LoRA)."""
        view = self.pool.view(row, row + 1)
        ids_S = torch.tensor(ids, device=self.device)
        logits_SV = None
        if isinstance(self.decode_step, NativeStep) and not adapter:
            logits_SV = self.decode_step.verify(ids_S, view)
        if logits_SV is None and adapter:
            assert self.lora is not None
            with self.lora.rows(torch.tensor([adapter], device=self.device)):
                logits_SV = self.model(ids_S[None], kv_cache=view)[0]
        elif logits_SV is None:
            logits_SV = self.model(ids_S[None], kv_cache=view)[0]
        self.pool.sync(view, row)
        return logits_SV

    def truncate(self, row: int, length: int) -> None:
        """Forget pool row `row`'s cached positions from `length` on."""
        self.pool.truncate(row, length)

    def last_logits(self, ids_BS: torch.Tensor, view: KVCache) -> torch.Tensor:
        """Logits [B, V] of each row's last position only: the final norm and head run on B
        vectors, not B·S (a prefill's other positions need no logits). A bf16 prefill runs in
        C where the decode steps do (`NativeStep.prefill`)."""
        adapted = self.lora is not None and self.lora.index_B is not None
        if isinstance(self.decode_step, NativeStep) and not adapted:
            logits = self.decode_step.prefill(ids_BS, view)
            if logits is not None:
                return logits
        return self.model(ids_BS, kv_cache=view, logits_to_keep=1)[:, -1]

    def full_logits(
        self, ids_BS: torch.Tensor, mask_BS: torch.Tensor | None, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """Logits [B, S, V] of every position (scoring), appended to `kv_cache` when given."""
        return self.model(ids_BS, key_padding_mask_BS=mask_BS, kv_cache=kv_cache)

    def scoring_cache(self, rows: int, slots: int) -> KVCache:
        """A cache apart from the generation pool (scoring runs between steps, beside it)."""
        return SlotPool(self.model, rows, slots).cache
