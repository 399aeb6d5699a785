"""The generation engine: a pre-allocated KV cache, prefill then decode, continuous batching.

Shapes: B active rows (one per sampled sequence, N per beam-search request), V vocab.

`step()` is one iteration of the engine loop: cancelled requests leave, one decode forward runs
over every active row (one new token each, rows of different lengths side by side in the cache),
waiting requests that fit are prefilled into free rows, then every row picks its next token —
greedy or sampled rows together, beam-search requests per request. Finished sequences leave and
the pool packs the surviving rows. Everything is synchronous and single-threaded; `submit` and
`cancel` are the only calls safe from other threads (the async front end uses them).

The engine is the loop around two parts, each in its own module, as vLLM v1's: the scheduler
(engine/scheduler.py: which waiting requests take rows) and the model runner
(engine/model_runner.py: weight layout, decode path, KV-cache pool, CUDA graphs, forwards).
What stays here is the requests' life: inbox, rows, token picking (sampling, beams, stop
strings), cancellation and per-request failure.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.beam_search import BeamSearch
from engine.cache_plan import CachePlan
from engine.config import EngineConfig
from engine.detokenize import TextTracker
from engine.grammar import GrammarMatcher, grammar_problem, mask_rows
from engine.lora_adapters import AdapterSet, PreparedAdapter
from engine.model_runner import ModelRunner
from engine.paged_pool import PagedPool, Prefill
from engine.requests import (
    Finish,
    GenerationRequest,
    RequestError,
    ScoreResult,
    SequenceResult,
    StepEvent,
)
from engine.requests import collect as collect_events
from engine.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    sample_rows,
    warp,
)
from engine.scheduler import Scheduler
from engine.scoring import score_batch
from engine.slots import SlotPool
from engine.speculative import AdaptedRows, DraftModel, Speculator, accept_or_resample
from engine.tokens import TokenizerInfo
from engine.validation import (
    InvalidRequest,
    Problem,
    RequestLimits,
    request_problems,
    rows_needed,
)
from models.kv_cache import KVCache
from models.transformer import CausalLM

log = logging.getLogger(__name__)
TOKENS_COMPUTED_KEPT = 1024
"""Requests whose `tokens_computed` count the engine remembers (oldest forgotten first)."""


def hidden_states(model: CausalLM, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The model's output before its head (after the final norm when it has one).

    CausalLM returns hidden states while `lm_head` is None; only the engine thread runs the
    model, so detaching the head for one call is safe.
    """
    head = model.lm_head
    model.lm_head = None
    try:
        return model(x, **kwargs)
    finally:
        model.lm_head = head


def head_logits(model: CausalLM, h_BxE: torch.Tensor) -> torch.Tensor:
    """The output head on hidden states [..., E] (normalised rows for norm_head models)."""
    head = model.lm_head
    if head is None:
        raise ValueError("Engine: the model has no output head (a pipeline stage?)")
    if model.config.norm_head:
        return F.linear(h_BxE, F.normalize(head.weight, dim=-1))
    return head(h_BxE)


@dataclass
class _Sequence:
    """One greedy or sampled sequence (a row of its own)."""

    request: GenerationRequest
    index: int
    seed: int
    generator: torch.Generator | None
    tracker: TextTracker
    seen: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    matcher: GrammarMatcher | None = None
    """Structured output: which tokens the request's grammar allows next (None: any)."""


@dataclass
class _Row:
    """An active cache row: the token it feeds next and who owns it."""

    pending: int
    request: GenerationRequest
    seq: _Sequence | None = None
    beam: BeamSearch | None = None


class Engine:
    """Serves generation and scoring for one loaded model.

    The engine owns the model: it is put in eval mode and, unless `cpu_linear` is "dense", its
    CPU linear layers are replaced by inference-only packed ones.
    """

    def __init__(
        self,
        model: CausalLM,
        tokens: TokenizerInfo,
        config: EngineConfig | None = None,
        *,
        draft_model: CausalLM | None = None,
    ) -> None:
        self.tokens = tokens
        self.config = config or EngineConfig()
        self.runner = ModelRunner(
            model,
            self.config,
            own_forward=self.runs_own_forward,
            agree_rows=self._agree_rows,
            pages_kv=self.pages_kv,
        )
        """Runs the model: weight layout, decode path, KV-cache pool, CUDA graphs."""
        self.speculation = self._build_speculator(draft_model)
        """Drafts and verifies several tokens per row and step (--speculative-config), or None."""
        self.scheduler = Scheduler()
        """Which waiting requests take cache rows next."""
        self.adapters = (
            AdapterSet(self.runner.lora, model.config) if self.runner.lora is not None else None
        )
        """The LoRA adapters requests may name (--enable-lora), or None."""
        self.weights_generation = 0
        """Times the served weights were replaced in place (`weights_changed`): part of every
        prefix-cache namespace, so KV blocks computed with older weights are never reused."""
        self._rows: list[_Row] = []
        # Paged cache: admitted requests whose prompts are still being computed, oldest first.
        self._prefills: list[Prefill] = []
        # Paged cache: when each running or prefilling request was (last) admitted, and the
        # sequences of preempted one-row requests waiting to be recomputed and go on.
        self._admitted: dict[int, int] = {}
        self._admissions = itertools.count()
        self._preempted: dict[int, _Sequence] = {}
        self.preemptions = 0
        """Requests preempted since start (paged cache: blocks ran out; recomputed later)."""
        # Filled by other threads, drained at the start of each step (under the lock).
        self._inbox: list[GenerationRequest] = []
        self._cancel_inbox: set[int] = set()
        self._live: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.steps = 0
        # Tokens fed to the model per request (tests check cancellation stops work); bounded,
        # so a long-running server does not keep one entry per request ever served.
        self.tokens_computed: OrderedDict[int, int] = OrderedDict()
        # Called after each step that ran the model (metrics): the engine, on its thread.
        self.on_step: Callable[[Engine], None] | None = None

    pages_kv = True
    """Whether this engine may page its KV cache (engines whose ranks must agree on every
    cache row keep dense rows)."""

    def _build_speculator(self, draft_model: CausalLM | None) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            if draft_model is not None:
                raise ValueError("Engine: a draft model needs --speculative-config")
            return None
        if self.runs_own_forward:
            raise ValueError(
                "--speculative-config is not supported with --pipeline-parallel-size > 1; drop "
                "one of them"
            )
        if isinstance(self.pool, SlotPool) and self.pool.cache.is_ring:
            raise ValueError(
                "--speculative-config: the model has a sliding window, whose KV cache rings "
                "cannot roll back rejected draft tokens; serve it without speculation"
            )
        if (spec.method == "draft_model") != (draft_model is not None):
            raise ValueError(
                "Engine: --speculative-config method 'draft_model' needs its draft model "
                "loaded (engine.build.build_engine loads it), and only that method takes one"
            )
        draft = None
        if draft_model is not None:
            draft = DraftModel(draft_model, self.max_seq_len, spec.num_speculative_tokens)
        log.info("%s", spec.describe())
        return Speculator(spec, draft)

    runs_own_forward = False
    """Whether `_last_logits` / `_full_logits` are this engine's own (a pipeline stage sends
    hidden states between processes): the runner then keeps every fast decode path off."""

    def _agree_rows(self, rows: int, device: torch.device) -> int:
        """Cache rows every process of this engine allocates (one process: its own plan)."""
        return rows

    @property
    def model(self) -> CausalLM:
        """The served model (owned by the runner)."""
        return self.runner.model

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.runner.device

    @property
    def context_length(self) -> int:
        """The model's context length (max_position_embeddings, longer under dynamic RoPE)."""
        return self.runner.context_length

    @property
    def max_seq_len(self) -> int:
        """Tokens per sequence, prompt + new (--max-model-len)."""
        return self.runner.max_model_len

    @property
    def pool(self) -> SlotPool | PagedPool:
        """The KV-cache rows (dense) or blocks and block tables (paged)."""
        return self.runner.pool

    @property
    def cache_plan(self) -> CachePlan:
        """The KV cache's size and why."""
        return self.runner.cache_plan

    @property
    def cpu_linear(self) -> str:
        """The CPU weight layout in use (--cpu-linear "auto" resolved)."""
        return self.runner.cpu_linear

    # -- thread-safe entry points -------------------------------------------------------------

    def weights_changed(self) -> None:
        """The served weights were replaced in place (an UpdateWeights RPC): from now on prompts
        hash into a new prefix-cache namespace, so no block computed with the old weights is
        shared again (those blocks age out of the cache by LRU). Call on the engine thread."""
        self.weights_generation += 1

    def submit(self, prompt_ids: list[int], config: SamplingConfig, adapter: str = "") -> int:
        """Queue a request, computed with LoRA adapter `adapter` ("" for the base model);
        returns its id. Raises ValueError (InvalidRequest) when it can never run here."""
        self.check_request(prompt_ids, config)
        with self._lock:  # the slot cannot be reassigned before the request is in the inbox
            slot = self.adapter_slot(adapter)
            request = GenerationRequest(next(self._ids), list(prompt_ids), config, slot)
            self._inbox.append(request)
            self._live.add(request.request_id)
        return request.request_id

    def adapter_slot(self, adapter: str) -> int:
        """The LoRA slot of adapter name `adapter` (0 for ""); InvalidRequest (field `model`)
        when no adapter of that name is loaded."""
        if not adapter:
            return 0
        if self.adapters is None:
            raise InvalidRequest(
                [
                    Problem(
                        "model",
                        "this server serves no LoRA adapters (start it with "
                        "--enable-lora or --lora-modules)",
                    )
                ]
            )
        return self.adapters.slot_of(adapter)

    def install_adapter(self, adapter: PreparedAdapter, label: str) -> int:
        """Serve a prepared LoRA adapter (AdapterSet.prepare); its slot. Call between steps
        (on the engine thread): a running forward must not see a slot change."""
        if self.adapters is None:
            raise ValueError(f"{label}: this server serves no LoRA adapters (--enable-lora)")
        busy = {row.request.adapter for row in self._rows}
        busy |= {p.request.adapter for p in self._prefills}
        busy |= {r.adapter for r in self.scheduler.waiting}
        with self._lock:  # no submit resolves a name while a slot changes hands
            busy |= {r.adapter for r in self._inbox}
            return self.adapters.install(adapter, busy, label)

    def remove_adapter(self, name: str, label: str) -> None:
        """Stop serving LoRA adapter `name` to new requests (running ones finish with it)."""
        if self.adapters is None:
            raise ValueError(f"{label}: this server serves no LoRA adapters (--enable-lora)")
        with self._lock:
            self.adapters.remove(name, label)

    def cancel(self, request_id: int) -> None:
        """Stop a request at the next step (its sequences end with Finish.CANCELLED)."""
        with self._lock:
            if request_id in self._live:
                self._cancel_inbox.add(request_id)

    def load(self) -> tuple[int, int]:
        """(active cache rows, requests waiting for rows or still prefilling); read on the
        engine thread."""
        return len(self._rows), len(self.scheduler) + len(self._prefills)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        with self._lock:
            return bool(self._live)

    def request_limits(self) -> RequestLimits:
        """What this engine can run: its model length, cache rows and vocabulary."""
        return RequestLimits(
            max_model_len=self.max_seq_len,
            max_rows=self.pool.max_rows,
            vocab_size=self.tokens.vocab_size,
        )

    def check_request(self, prompt_ids: list[int], config: SamplingConfig) -> None:
        """InvalidRequest (a ValueError) listing every problem when a request cannot run here
        (engine.validation; a long generation is cut at the model length, not refused)."""
        problems = request_problems(prompt_ids, config, self.request_limits(), whole=False)
        pool = self.pool
        if not problems and isinstance(pool, PagedPool):
            need = pool.blocks_needed(len(prompt_ids), rows_needed(config), config.max_new_tokens)
            if need > pool.blocks.num_blocks:
                problems = [
                    Problem(
                        "max_new_tokens",
                        f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                        f"({config.max_new_tokens}) x {rows_needed(config)} row(s) needs {need} "
                        f"KV blocks of {pool.block_size} tokens; the cache holds "
                        f"{pool.blocks.num_blocks} (--kv-cache-memory): ask fewer new tokens "
                        "or raise --kv-cache-memory",
                    )
                ]
        if not problems and config.grammar is not None:
            reason = grammar_problem(config.grammar, self.tokens)
            if reason is not None:
                problems = [Problem("grammar", reason)]
            else:
                problems = self._grammar_budget_problems(prompt_ids, config)
        if problems:
            raise InvalidRequest(problems)

    def _grammar_budget_problems(
        self, prompt_ids: list[int], config: SamplingConfig
    ) -> list[Problem]:
        """A grammar whose shortest completion found is longer than the tokens the request may
        emit could only end cut: refused, naming the budget it needs."""
        budget = min(config.max_new_tokens, self.max_seq_len - len(prompt_ids))
        plan = GrammarMatcher(config.grammar or "", self.tokens).plan()
        if plan is None or len(plan) <= budget:
            return []
        return [
            Problem(
                "max_new_tokens",
                f"the grammar's shortest answer found takes {len(plan)} tokens, more than the "
                f"{budget} this request may generate: ask at least {len(plan)} new tokens",
            )
        ]

    def fits_context(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether prompt + new tokens fit --max-model-len (engine.validation.fit_problems says why)."""
        return prompt_len + max_new_tokens <= self.max_seq_len

    # -- the loop ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One engine iteration; returns the events it produced (new tokens, finished sequences)."""
        events: list[StepEvent] = []
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancelled, self._cancel_inbox = self._cancel_inbox, set()
        inbox, cancelled = self._sync_inbox(inbox, cancelled)
        with self._lock:
            self._live.update(r.request_id for r in inbox)
        self.scheduler.add(inbox)
        if cancelled:
            self._drop_cancelled(cancelled, events)
        # Whatever goes wrong with one request's part of the step lands here; it fails alone.
        failed: dict[int, RequestError] = {}
        logits: list[torch.Tensor] = []
        # Rows [0, first) picked their tokens while speculating (engine/speculative.py).
        speculated: dict[int, int | None] = {}
        if self._rows and isinstance(self.pool, PagedPool):
            self._make_room()
        if self._rows:
            if self._speculates():
                speculated = self._speculate(events, failed)
            else:
                logits += self._decode(failed)
        first = len(speculated)
        logits += self._admit_paged(failed) if self.runner.paged else self._admit(failed)
        if not self._rows:
            self._report_failures(failed, events)
            self._settle()
            return events
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)
        plain, beams = dict(speculated), {}
        if logits:
            logits_BV = (logits[0] if len(logits) == 1 else torch.cat(logits)).float()
            plain.update(self._pick_plain(logits_BV, events, failed, first))
            beams = self._pick_beams(logits_BV, events, failed, first)
        self._name_generated(failed)
        keep: list[int] = []
        kept_rows: list[_Row] = []
        for i, row in enumerate(self._rows):
            if row.request.request_id in failed:
                continue
            token = plain.get(i)
            if row.seq is not None and token is not None:
                keep.append(i)
                kept_rows.append(_Row(token, row.request, seq=row.seq))
            elif row.beam is not None and beams.get(i):
                # Beam j of the next step continues source beam `src` of this block.
                for src, token in beams[i]:
                    keep.append(i + src)
                    kept_rows.append(_Row(token, row.request, beam=row.beam))
        self.pool.gather(keep)
        self._rows = kept_rows
        self._report_failures(failed, events)
        self._finish_requests(events)
        self._settle()
        return events

    def _name_generated(self, failed: dict[int, RequestError]) -> None:
        """Paged cache with prefix caching: name the blocks sequences filled this step (before
        finished rows leave), so a later prompt holding prompt + answer finds them. Beam rows
        are not named (their tokens live in the beam search until it ends)."""
        pool = self.pool
        if not isinstance(pool, PagedPool) or not pool.blocks.prefix_caching:
            return
        for i, row in enumerate(self._rows):
            if row.seq is not None and row.request.request_id not in failed:
                pool.name_generated(i, row.request.prompt_ids, row.seq.tokens)

    def _settle(self) -> None:
        """Paged cache: requests with no row and no prefill left return their block credit."""
        if isinstance(self.pool, PagedPool):
            running = {row.request.request_id for row in self._rows}
            running.update(p.request.request_id for p in self._prefills)
            self.pool.settle(running)
            for rid in self._admitted.keys() - running:
                del self._admitted[rid]

    def _make_room(self) -> None:
        """Paged cache: promise every one-row request the blocks this step writes, oldest
        admitted first; when none are left, preempt the most recently admitted one-row request
        (running or prefilling) until they suffice, or the request itself was preempted."""
        pool = self.pool
        assert isinstance(pool, PagedPool)
        writes = 1
        if self.speculation is not None:  # drafts are written before they are verified
            writes += self.speculation.config.num_speculative_tokens
        covered: set[int] = set()
        while True:  # once more after each preemption (rows moved; some left)
            rows = {
                r.request.request_id: i for i, r in enumerate(self._rows) if pool.grows(r.request)
            }
            for rid in sorted(rows.keys() - covered, key=self._admitted.__getitem__):
                if not pool.blocks.cover(rid, pool.blocks_to_write(rows[rid], writes)):
                    self._preempt_newest()
                    break
                covered.add(rid)
            else:
                return

    def _preempt_newest(self) -> None:
        """Preempt the most recently admitted one-row request: its blocks go back and it is
        queued first, to recompute its prompt and generated tokens and go on from there."""
        pool = self.pool
        assert isinstance(pool, PagedPool)
        candidates = [row.request for row in self._rows if pool.grows(row.request)]
        candidates += [p.request for p in self._prefills if pool.grows(p.request)]
        victim = max(candidates, key=lambda r: self._admitted[r.request_id])
        rid = victim.request_id
        prefill = next((p for p in self._prefills if p.request is victim), None)
        if prefill is not None:
            self._drop_prefill(prefill)
        else:
            row = next(i for i, r in enumerate(self._rows) if r.request is victim)
            seq = self._rows[row].seq
            assert seq is not None
            self._preempted[rid] = seq
            pool.preempt(row)
            del self._rows[row]
        del self._admitted[rid]
        self.scheduler.requeue(victim)
        self.preemptions += 1
        log.info("KV blocks ran out: request %d preempted, to be recomputed", rid)

    def _decode(self, failed: dict[int, RequestError]) -> list[torch.Tensor]:
        """One new token for every active row; logits [B, V] (as a list of at most one tensor).

        When the batched forward fails, each row runs alone: rows that fail again fail their
        request (its rows leave), the others go on. The cache is safe to retry: a failed
        forward never commits its rows' lengths, so the retry rewrites the same slots.
        """
        n = len(self._rows)
        ids_B1 = torch.tensor([[row.pending] for row in self._rows], device=self.device)
        try:
            logits = [self._decode_rows(ids_B1, 0, n, compiled=True)]
        except Exception as exc:  # isolated per row below
            log.warning("batched decode of %d rows failed (%s); retrying row by row", n, exc)
            logits = self._decode_row_by_row(ids_B1, failed)
        for row in self._rows:
            self._count_tokens(row.request.request_id, 1)
        return logits

    def _decode_rows(
        self, ids_B1: torch.Tensor, start: int, stop: int, compiled: bool = False
    ) -> torch.Tensor:
        """Logits [B, V] of rows [start, stop) fed `ids_B1` (when `compiled`: the compiled forward,
        or the CUDA graphs for all active rows; see ModelRunner.decode)."""
        adapters_B = self._adapter_rows([row.request for row in self._rows[start:stop]])
        return self.runner.decode(ids_B1, start, stop, self._last_logits, compiled, adapters_B)

    def _adapter_rows(self, requests: list[GenerationRequest]) -> torch.Tensor | None:
        """Each row's LoRA slot [B], or None when no row has an adapter (the fast paths)."""
        if not any(r.adapter for r in requests):
            return None
        return torch.tensor([r.adapter for r in requests], device=self.device)

    def _decode_row_by_row(
        self, ids_B1: torch.Tensor, failed: dict[int, RequestError]
    ) -> list[torch.Tensor]:
        by_row: dict[int, torch.Tensor] = {}
        for i, row in enumerate(self._rows):
            rid = row.request.request_id
            if rid in failed:
                continue
            try:
                by_row[i] = self._decode_rows(ids_B1[i : i + 1], i, i + 1)
            except Exception as exc:  # this request fails, not the step
                failed[rid] = RequestError(rid, "decoding (the model forward)", exc)
        keep = [i for i in by_row if self._rows[i].request.request_id not in failed]
        self.pool.gather(keep)
        self._rows = [self._rows[i] for i in keep]
        return [torch.cat([by_row[i] for i in keep])] if keep else []

    def _speculates(self) -> bool:
        """Whether this step's decode speculates: a speculative server, every active row a
        greedy or sampled sequence without a grammar (beam search does not speculate, and a
        grammar's matcher is not rolled back with rejected drafts), and not too many rows."""
        if self.speculation is None:
            return False
        self.speculation.retain({(r.request.request_id, r.seq.index) for r in self._rows if r.seq})
        return all(
            r.seq is not None and r.seq.matcher is None for r in self._rows
        ) and self.speculation.applies(len(self._rows))

    def _speculate(
        self, events: list[StepEvent], failed: dict[int, RequestError]
    ) -> dict[int, int | None]:
        """Each active row drafts, verifies and emits its tokens (engine/speculative.py); per
        row the token it feeds next, or None when its sequence ended (or its request failed)."""
        assert self.speculation is not None
        picks: dict[int, int | None] = {}
        for i, row in enumerate(self._rows):
            seq = row.seq
            assert seq is not None
            rid = row.request.request_id
            if rid in failed:
                picks[i] = None
                continue
            done = len(seq.tokens)
            context = seq.request.prompt_ids + seq.tokens
            # Every token a step emits must fit the request and --max-model-len.
            budget = min(
                seq.request.config.max_new_tokens - done - 1, self.max_seq_len - len(context)
            )

            def pick(
                logits_1V: torch.Tensor,
                draft: int | None,
                q_V: torch.Tensor | None,
                seq: _Sequence = seq,
            ) -> tuple[int, bool]:
                return self._pick_verified(seq, logits_1V.float(), draft, q_V, events)

            try:
                picks[i] = self.speculation.step_row(
                    AdaptedRows(self.runner, row.request.adapter),
                    i,
                    (rid, seq.index),
                    context,
                    budget,
                    seq.request.config,
                    seq.generator,
                    pick,
                )
            except Exception as exc:  # this request fails, not the step
                failed[rid] = RequestError(rid, "decoding speculatively (the model forward)", exc)
                picks[i] = None
            self._count_tokens(rid, len(seq.tokens) - done)
        return picks

    def _pick_verified(
        self,
        seq: _Sequence,
        logits_1V: torch.Tensor,
        draft: int | None,
        q_V: torch.Tensor | None,
        events: list[StepEvent],
    ) -> tuple[int, bool]:
        """The token a speculative step emits at one verified position, as `_choose` would
        pick it, with the rejection rule where a sampled row has a draft token; emitted through
        `_advance`. Returns (token, whether its sequence ended)."""
        processed_1V, logprobs_1V = self._processed(logits_1V, [seq])
        if draft is not None and seq.generator is not None:
            token = accept_or_resample(processed_1V[0], draft, q_V, seq.generator)
        else:
            token = int(sample_rows(processed_1V, [seq.generator])[0])
        logprob = float(logprobs_1V[0, token])
        top = _top_logprobs(logprobs_1V, [seq.request.config.logprobs])[0]
        return token, self._advance(seq, token, logprob, events, top) is not None

    def _count_tokens(self, request_id: int, count: int) -> None:
        self.tokens_computed[request_id] = self.tokens_computed.get(request_id, 0) + count
        self.tokens_computed.move_to_end(request_id)
        while len(self.tokens_computed) > TOKENS_COMPUTED_KEPT:
            self.tokens_computed.popitem(last=False)

    def _last_logits(self, ids_BS: torch.Tensor, view: KVCache) -> torch.Tensor:
        """Logits [B, V] of each row's last position (ModelRunner.last_logits)."""
        return self.runner.last_logits(ids_BS, view)

    def _admit(self, failed: dict[int, RequestError]) -> list[torch.Tensor]:
        """Prefill waiting requests while rows are free; their first-token logits.

        Requests admitted together with equal prompt lengths share one forward (their rows are
        allocated next to each other), so a burst of same-length prompts prefills as a batch.
        When a shared prefill fails, each request of it runs alone; a request whose prefill or
        set-up (seeding, stop strings, beam state) fails leaves, and its rows are freed.
        """
        pool = self.pool
        assert isinstance(pool, SlotPool)  # the paged cache admits in _admit_paged
        admitted = self.scheduler.admit(pool.free_rows)
        for _, rows in admitted:
            pool.allocate(rows)
        if not admitted:
            return []
        placed: list[tuple[GenerationRequest, int, int, torch.Tensor | None]] = []
        start = len(self._rows)
        for _, group in itertools.groupby(admitted, key=lambda item: len(item[0].prompt_ids)):
            members = list(group)
            try:
                logits = self._prefill(members, start)
                chunks: list[torch.Tensor | None] = list(logits.split([n for _, n in members]))
            except Exception as exc:  # retried per request
                log.warning("batched prefill of %d requests failed (%s)", len(members), exc)
                chunks = []
                first = start
                for request, rows in members:
                    chunks.append(self._prefill_alone(request, rows, first, failed))
                    first += rows
            for (request, rows), chunk in zip(members, chunks, strict=True):
                placed.append((request, rows, start, chunk))
                start += rows
        out: list[torch.Tensor] = []
        keep = list(range(len(self._rows)))
        for request, rows, first, chunk in placed:
            if chunk is None:
                continue
            rid = request.request_id
            try:
                new_rows = self._new_rows(request, rows)
            except Exception as exc:  # this request fails, not the step
                failed[rid] = RequestError(
                    rid, "setting up its sequences (seed, stop strings)", exc
                )
                continue
            self._count_tokens(rid, len(request.prompt_ids))
            self._rows += new_rows
            keep += range(first, first + rows)
            out.append(chunk)
        self.pool.gather(keep)
        return out

    def _admit_paged(self, failed: dict[int, RequestError]) -> list[torch.Tensor]:
        """Paged cache: compute the next prompt chunks within the step's token budget (running
        prefills first, then newly admitted requests); first-token logits of the prompts that
        complete, whose rows then join the active rows (their blocks shared by all of them).

        Chunks at the same position and of the same length run as one forward; a failed
        forward is retried per request, and a request failing alone leaves (blocks freed)."""
        pool = self.pool
        assert isinstance(pool, PagedPool)
        budget = self.runner.max_num_batched_tokens
        left = [None if budget is None else budget - len(self._rows)]
        plan: list[tuple[Prefill, int]] = []

        def take(prefill: Prefill) -> None:
            n = prefill.remaining if left[0] is None else min(prefill.remaining, left[0])
            plan.append((prefill, n))
            if left[0] is not None:
                left[0] -= n

        def room() -> bool:
            return left[0] is None or left[0] > 0

        for prefill in self._prefills:
            if not room():
                break
            take(prefill)

        def admit(request: GenerationRequest) -> Prefill | bool | None:
            namespace = b"" if self.adapters is None else self.adapters.namespace(request.adapter)
            if self.weights_generation:
                namespace += b"weights:" + self.weights_generation.to_bytes(8, "little")
            resumed = self._preempted.get(request.request_id)
            tokens = None if resumed is None else request.prompt_ids + resumed.tokens
            admitted = pool.admit(request, namespace, tokens)
            if isinstance(admitted, Prefill):  # its chunk counts before the next is offered
                self._prefills.append(admitted)
                self._admitted[request.request_id] = next(self._admissions)
                take(admitted)
            return admitted

        self.scheduler.admit_each(admit, room)
        out: list[torch.Tensor] = []
        for (_, n), group in itertools.groupby(plan, key=lambda item: (item[0].done, item[1])):
            members = [prefill for prefill, _ in group]
            try:
                chunks = list(self._prefill_chunk(members, n).split(1))
            except Exception as exc:  # retried per request
                log.warning("batched prefill of %d prompts failed (%s)", len(members), exc)
                chunks = [self._chunk_alone(prefill, n, failed) for prefill in members]
            for prefill, chunk in zip(members, chunks, strict=True):
                rid = prefill.request.request_id
                if chunk is None:
                    continue
                self._count_tokens(rid, n)
                if prefill.remaining:
                    continue
                try:
                    resumed = self._preempted.pop(rid, None)
                    new_rows = (
                        [_Row(-1, prefill.request, seq=resumed)]
                        if resumed is not None
                        else self._new_rows(prefill.request, prefill.rows)
                    )
                except Exception as exc:  # this request fails, not the step
                    failed[rid] = RequestError(
                        rid, "setting up its sequences (seed, stop strings)", exc
                    )
                    self._drop_prefill(prefill)
                    continue
                self._prefills.remove(prefill)
                pool.join(prefill)
                self._rows += new_rows
                out.append(chunk.expand(prefill.rows, -1))
        return out

    def _prefill_chunk(self, prefills: list[Prefill], tokens: int) -> torch.Tensor:
        """Logits [B, V] after the next `tokens` prompt tokens of prefills at the same length,
        each with its request's LoRA adapter."""
        adapters_B = self._adapter_rows([p.request for p in prefills])
        return self.runner.prefill_chunk(prefills, tokens, self._last_logits, adapters_B)

    def _chunk_alone(
        self, prefill: Prefill, tokens: int, failed: dict[int, RequestError]
    ) -> torch.Tensor | None:
        try:
            return self._prefill_chunk([prefill], tokens)
        except Exception as exc:  # this request fails, not the step
            rid = prefill.request.request_id
            failed[rid] = RequestError(rid, "prefilling its prompt (the model forward)", exc)
            self._drop_prefill(prefill)
            return None

    def _drop_prefill(self, prefill: Prefill) -> None:
        self._prefills.remove(prefill)
        assert isinstance(self.pool, PagedPool)
        self.pool.abandon(prefill)

    def _prefill(self, members: list[tuple[GenerationRequest, int]], start: int) -> torch.Tensor:
        """First-token logits [rows, V] of same-length prompts prefilled together from pool row
        `start` (dense rows; each request's rows follow each other).

        A request of several rows (samples or beams of one prompt) is prefilled once: prompt i
        goes to row start + i, then its rows are made copies of that row, last request first
        (request i's rows begin at or after start + i, so no prompt row is overwritten before
        it is copied). GRPO's groups are such requests: a group of 8 prefilled 8 times cost
        as much as its whole decode in bench/bench_rollouts.py."""
        requests = [r for r, _ in members]
        counts = [rows for _, rows in members]
        prompts = [r.prompt_ids for r in requests]
        logits_MV = self.runner.prefill(
            prompts, start, self._last_logits, self._adapter_rows(requests)
        )
        if all(rows == 1 for rows in counts):
            return logits_MV
        pool = self.pool
        assert isinstance(pool, SlotPool)
        firsts = list(itertools.accumulate(counts[:-1], initial=start))
        for i in reversed(range(len(members))):
            if counts[i] > 1 or firsts[i] != start + i:
                pool.copy_row(start + i, firsts[i], firsts[i] + counts[i])
        return logits_MV.repeat_interleave(torch.tensor(counts, device=logits_MV.device), dim=0)

    def _prefill_alone(
        self, request: GenerationRequest, rows: int, start: int, failed: dict[int, RequestError]
    ) -> torch.Tensor | None:
        try:
            return self._prefill([(request, rows)], start)
        except Exception as exc:  # this request fails, not the step
            rid = request.request_id
            failed[rid] = RequestError(rid, "prefilling its prompt (the model forward)", exc)
            return None

    def _new_rows(self, request: GenerationRequest, rows: int) -> list[_Row]:
        cfg = request.config
        if cfg.num_beams > 1:
            gen = self._generator(cfg.seed) if cfg.sampling else None
            matcher = None if cfg.grammar is None else GrammarMatcher(cfg.grammar, self.tokens)
            beam = BeamSearch(
                cfg, request.prompt_ids, self.tokens.eos_id, self.device, gen, matcher
            )
            return [_Row(-1, request, beam=beam) for _ in range(rows)]
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
        out = []
        for i in range(rows):
            seed = cfg.seed + i
            seq = _Sequence(
                request,
                i,
                seed,
                self._generator(seed) if cfg.sampling else None,
                TextTracker(self.tokens.decode, cfg.stop),
                prompt,
                matcher=None if cfg.grammar is None else GrammarMatcher(cfg.grammar, self.tokens),
            )
            out.append(_Row(-1, request, seq=seq))
        return out

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _pick_plain(
        self,
        logits_BV: torch.Tensor,
        events: list[StepEvent],
        failed: dict[int, RequestError],
        first: int = 0,
    ) -> dict[int, int | None]:
        """Next token of every greedy/sampled row from `first` on (logits row b is active row
        first + b; batched) and its event; per row the token it feeds next, or None when its
        sequence ended (or its request failed).

        When the batched pick fails, each row picks alone and a row that fails again fails its
        request; a sequence whose text update (detokenisation, stop strings) fails does too.
        """
        rows = self._rows[first:]
        index = [first + i for i, row in enumerate(rows) if row.seq is not None]
        picks: dict[int, int | None] = {}
        if not index:
            return picks
        seqs = [row.seq for row in rows if row.seq is not None]
        logits_PV = logits_BV if len(index) == len(rows) else logits_BV[[i - first for i in index]]
        next_P: list[int | None]
        tops: list[list[tuple[int, float]] | None]
        try:
            next_P, picked_P, tops = self._choose(logits_PV, seqs)  # type: ignore[assignment]
        except Exception as exc:  # retried per row
            log.warning("batched sampling of %d rows failed (%s); row by row", len(seqs), exc)
            next_P, picked_P, tops = [], [], []
            for p, seq in enumerate(seqs):
                rid = seq.request.request_id
                try:
                    tokens, logprobs, row_tops = self._choose(logits_PV[p : p + 1], [seq])
                    next_P.append(tokens[0])
                    picked_P.append(logprobs[0])
                    tops.append(row_tops[0])
                except Exception as row_exc:  # this request fails
                    failed.setdefault(rid, RequestError(rid, "sampling its next token", row_exc))
                    next_P.append(None)
                    picked_P.append(0.0)
                    tops.append(None)
        for row_i, seq, token, lp, top in zip(index, seqs, next_P, picked_P, tops, strict=True):
            rid = seq.request.request_id
            if token is None or rid in failed:
                picks[row_i] = None
                continue
            try:
                finish = self._advance(seq, token, lp, events, top)
            except Exception as exc:  # this request fails, not the step
                failed[rid] = RequestError(rid, "detokenising its text (stop strings)", exc)
                picks[row_i] = None
                continue
            picks[row_i] = token if finish is None else None
        return picks

    def _choose(
        self, logits_PV: torch.Tensor, seqs: list[_Sequence]
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
        """Token, its log-probability and (when the request asks for logprobs) the top
        alternatives per row: repetition penalty, warping, then greedy or a draw. Raises before
        any generator draws when a sampled row has nothing to draw from."""
        processed_PV, logprobs_PV = self._processed(logits_PV, seqs)
        next_t = sample_rows(processed_PV, [s.generator for s in seqs])
        if any(s.matcher is not None for s in seqs):
            next_t = self._steered(next_t, seqs)
        picked_P = logprobs_PV.gather(1, next_t[:, None])[:, 0]
        tops = _top_logprobs(logprobs_PV, [s.request.config.logprobs for s in seqs])
        return next_t.tolist(), picked_P.tolist(), tops

    def _steered(self, next_P: torch.Tensor, seqs: list[_Sequence]) -> torch.Tensor:
        """The picks with each constrained row steered so that its grammar still completes
        within the tokens it has left (GrammarMatcher.steer: the model's pick, or its plan's)."""
        picks = next_P.tolist()
        for p, seq in enumerate(seqs):
            if seq.matcher is not None:
                picks[p] = seq.matcher.steer(picks[p], self._tokens_left(seq))
        return torch.tensor(picks, dtype=next_P.dtype, device=next_P.device)

    def _tokens_left(self, seq: _Sequence) -> int:
        """How many tokens the sequence may still emit, the next one included."""
        done = len(seq.tokens)
        cfg = seq.request.config
        return min(cfg.max_new_tokens - done, self.max_seq_len - len(seq.request.prompt_ids) - done)

    def _processed(
        self, logits_PV: torch.Tensor, seqs: list[_Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Logits after repetition penalty and warping, log-probabilities of the raw logits);
        raises when a sampled row has nothing to draw from."""
        logprobs_PV = torch.log_softmax(logits_PV, dim=-1)
        configs = [s.request.config for s in seqs]
        processed_PV = apply_repetition_penalty(
            mask_rows(logits_PV, [s.matcher for s in seqs]),
            [s.seen for s in seqs],
            [c.repetition_penalty for c in configs],
        )
        processed_PV = warp(processed_PV, configs)
        sampled = [s.generator is not None for s in seqs]
        if any(sampled):
            rows_SV = processed_PV
            if not all(sampled):
                rows_SV = processed_PV[torch.tensor(sampled, device=processed_PV.device)]
            # One pass: the log-sum-exp is finite iff a row has no NaN, no +inf and some value
            # above -inf (three passes over [rows, V] were ~10% of a small model's step).
            if not bool(rows_SV.float().logsumexp(-1).isfinite().all()):
                raise ValueError("the processed logits of a sampled row have no finite value")
        return processed_PV, logprobs_PV

    def _advance(
        self,
        seq: _Sequence,
        token: int,
        logprob: float,
        events: list[StepEvent],
        top: list[tuple[int, float]] | None = None,
    ) -> Finish | None:
        """Append a token to a sequence and emit its event; returns why it ended, if it did."""
        cfg = seq.request.config
        if seq.matcher is not None:
            seq.matcher.advance(token)
        seq.tokens.append(token)
        seq.logprob += logprob
        if cfg.repetition_penalty != 1.0:
            seq.seen = torch.cat([seq.seen, seq.seen.new_tensor([token])])
        finish = None
        if token == self.tokens.eos_id:
            finish = Finish.STOP
        elif len(seq.tokens) >= cfg.max_new_tokens or (
            len(seq.request.prompt_ids) + len(seq.tokens) >= self.max_seq_len
        ):
            # A grammar completed at the limit is a whole answer (only EOS could follow), not
            # a cut one: OpenAI clients' parse helpers refuse "length" (docs/decisions.md).
            complete = seq.matcher is not None and seq.matcher.is_complete()
            finish = Finish.STOP if complete else Finish.LENGTH
        text, matched = seq.tracker.update(seq.tokens, final=finish is not None)
        if matched:
            finish = Finish.STOP_STRING
            text += seq.tracker.update(seq.tokens, final=True)[0]
        event = StepEvent(
            seq.request.request_id, seq.index, [token], text, seq.logprob, seq.seed, finish
        )
        if top is not None:
            event.token_logprobs, event.top_logprobs = [logprob], [top]
        events.append(event)
        return finish

    def _pick_beams(
        self,
        logits_BV: torch.Tensor,
        events: list[StepEvent],
        failed: dict[int, RequestError],
        first: int = 0,
    ) -> dict[int, list[tuple[int, int]]]:
        """One beam-search step per beam request from active row `first` on (logits row b is
        active row first + b). Per first row of a block: (source beam, token) of each next
        beam, empty when the request finished (or failed: it is added to `failed` and the
        other requests go on)."""
        picks: dict[int, list[tuple[int, int]]] = {}
        i = first
        while i < len(self._rows):
            row = self._rows[i]
            if row.beam is None:
                i += 1
                continue
            beam, n = row.beam, row.beam.num_beams
            rid = row.request.request_id
            try:
                logits_NV = logits_BV[i - first : i - first + n]
                picks[i] = self._beam_step(row.request, beam, logits_NV, events)
            except Exception as exc:  # this request fails, not the step
                failed[rid] = RequestError(rid, "taking a beam-search step", exc)
                picks[i] = []
            i += n
        return picks

    def _beam_step(
        self,
        request: GenerationRequest,
        beam: BeamSearch,
        logits_NV: torch.Tensor,
        events: list[StepEvent],
    ) -> list[tuple[int, int]]:
        """One step of one beam request: (source beam, token) of each next beam, or [] once
        done (its results are then appended to `events`)."""
        cfg = request.config
        stop_check = None
        if cfg.stop and self.tokens.decode is not None:
            tracker = TextTracker(self.tokens.decode, cfg.stop)

            def stop_check(ids: list[int], tracker: TextTracker = tracker) -> bool:
                return tracker.stop_index(ids) is not None

        sources, next_tokens = beam.step(logits_NV, stop_check)
        if not beam.done:
            return list(zip(sources, next_tokens, strict=True))
        results: list[StepEvent] = []
        self._emit_beam_results(request, beam, results)
        events += results
        return []

    def _emit_beam_results(
        self, request: GenerationRequest, beam: BeamSearch, events: list[StepEvent]
    ) -> None:
        for index, hyp in enumerate(beam.results()):
            if hyp.hit_stop_string:
                finish = Finish.STOP_STRING
            elif hyp.token_ids and hyp.token_ids[-1] == self.tokens.eos_id:
                finish = Finish.STOP
            else:
                finish = Finish.LENGTH
            tracker = TextTracker(self.tokens.decode, request.config.stop)
            text = tracker.update(hyp.token_ids, final=True)[0]
            events.append(
                StepEvent(
                    request.request_id,
                    index,
                    hyp.token_ids,
                    text,
                    hyp.logprob,
                    request.config.seed,
                    finish,
                )
            )

    def _sync_inbox(
        self, requests: list[GenerationRequest], cancelled: set[int]
    ) -> tuple[list[GenerationRequest], set[int]]:
        """New requests and cancellations this step applies (tensor-parallel ranks agree here)."""
        return requests, cancelled

    def _drop_cancelled(self, cancelled: set[int], events: list[StepEvent]) -> None:
        """Remove cancelled requests (waiting or running); their open sequences end CANCELLED."""
        dropped = self.scheduler.drop(cancelled)
        for prefill in [p for p in self._prefills if p.request.request_id in cancelled]:
            self._drop_prefill(prefill)
            dropped.append(prefill.request)
        for request in dropped:
            resumed = self._preempted.pop(request.request_id, None)
            if resumed is not None:  # preempted: its tokens so far were sent
                events.append(
                    StepEvent(
                        request.request_id,
                        0,
                        [],
                        "",
                        resumed.logprob,
                        resumed.seed,
                        Finish.CANCELLED,
                    )
                )
                continue
            events += [
                StepEvent(request.request_id, i, [], "", 0.0, request.config.seed, Finish.CANCELLED)
                for i in range(request.config.num_return_sequences)
            ]
        keep, kept_rows, seen_beams = [], [], set()
        for i, row in enumerate(self._rows):
            rid = row.request.request_id
            if rid not in cancelled:
                keep.append(i)
                kept_rows.append(row)
            elif row.seq is not None:
                seq = row.seq
                events.append(
                    StepEvent(rid, seq.index, [], "", seq.logprob, seq.seed, Finish.CANCELLED)
                )
            elif rid not in seen_beams:
                seen_beams.add(rid)
                for index in range(row.request.config.num_return_sequences):
                    events.append(
                        StepEvent(
                            rid, index, [], "", 0.0, row.request.config.seed, Finish.CANCELLED
                        )
                    )
        self.pool.gather(keep)
        self._rows = kept_rows
        with self._lock:
            self._live -= cancelled

    def _report_failures(self, failed: dict[int, RequestError], events: list[StepEvent]) -> None:
        """One error event per failed request (its rows are already gone); it is forgotten."""
        if not failed:
            return
        for rid, error in failed.items():
            log.warning("%s", error, exc_info=error.cause)
            self._preempted.pop(rid, None)  # a recompute that failed
            events.append(StepEvent(rid, 0, [], "", 0.0, 0, None, error=error))
        with self._lock:
            self._live -= failed.keys()

    def _finish_requests(self, events: list[StepEvent]) -> None:
        """Forget requests that hold no row and wait for nothing."""
        running = {row.request.request_id for row in self._rows}
        running.update(p.request.request_id for p in self._prefills)
        waiting = self.scheduler.waiting_ids()
        done = {e.request_id for e in events if e.finish is not None}
        with self._lock:
            self._live -= done - running - waiting

    def score(
        self, items: list[tuple[list[int], list[int]]], pad_id: int = 0, top_logprobs: int = 0
    ) -> list[ScoreResult]:
        """Log-probabilities of each (context ids, continuation ids) pair (see scoring.py);
        choices sharing a context run it once. `top_logprobs` > 0 also returns that many most
        likely tokens at each continuation position."""
        return score_batch(
            self._full_logits,
            items,
            device=self.device,
            pad_id=pad_id,
            new_cache=self._scoring_cache,
            top_logprobs=top_logprobs,
        )

    def _full_logits(
        self, ids_BS: torch.Tensor, mask_BS: torch.Tensor | None, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """Logits [B, S, V] of every position (scoring), appended to `kv_cache` when given."""
        return self.runner.full_logits(ids_BS, mask_BS, kv_cache)

    def _scoring_cache(self, rows: int, slots: int) -> KVCache:
        """A cache apart from the generation pool (scoring runs between steps, beside it)."""
        return self.runner.scoring_cache(rows, slots)

    def reset(self) -> set[int]:
        """Forget every request (after a failed step); the cache rows become free. Returns the
        ids of the requests forgotten."""
        with self._lock:
            forgotten = set(self._live)
            self._inbox.clear()
            self._cancel_inbox.clear()
            self._live.clear()
        self.scheduler.clear()
        self._rows = []
        self._prefills = []
        self._admitted.clear()
        self._preempted.clear()
        if isinstance(self.pool, PagedPool):
            self.pool.reset()
        else:
            self.pool.gather([])
        return forgotten

    def resize_cache(self, rows: int, slots: int) -> None:
        """Replace the dense KV cache by one of `rows` rows of `slots` slots while no request
        runs (colocated rollouts free it for training between calls: ModelRunner.resize_cache)."""
        if self.has_work():
            raise RuntimeError("Engine.resize_cache: requests are still running")
        self.runner.resize_cache(rows, slots)

    # -- synchronous helpers -----------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        configs: list[SamplingConfig],
        adapters: list[str] | None = None,
    ) -> list[list[SequenceResult]]:
        """Run requests to completion (batched together), request i with LoRA adapter
        `adapters[i]` ("" or None: the base model); results per request, in order."""
        names = adapters or [""] * len(prompts)
        ids = [self.submit(p, c, a) for p, c, a in zip(prompts, configs, names, strict=True)]
        events: dict[int, list[StepEvent]] = {rid: [] for rid in ids}
        while any(self._is_live(rid) for rid in ids):
            for event in self.step():
                events.setdefault(event.request_id, []).append(event)
        return [
            collect_events(events[rid], _num_sequences(c))
            for rid, c in zip(ids, configs, strict=True)
        ]

    def _is_live(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._live


def _top_logprobs(
    logprobs_PV: torch.Tensor, wanted: list[int]
) -> list[list[tuple[int, float]] | None]:
    """Per row, its `wanted[p]` most likely (id, log-prob), most likely first; None where 0."""
    k = max(wanted, default=0)
    if k == 0:
        return [None] * len(wanted)
    values_PK, ids_PK = logprobs_PV.topk(min(k, logprobs_PV.shape[-1]), dim=-1)
    values, ids = values_PK.tolist(), ids_PK.tolist()
    return [
        list(zip(ids[p][:n], values[p][:n], strict=True)) if n else None
        for p, n in enumerate(wanted)
    ]


def _num_sequences(config: SamplingConfig) -> int:
    return config.num_return_sequences
