"""Beam search for one request, step by step, with the semantics of HF `generate(num_beams=N)`.

Shapes: N beams, C = 2N candidates kept per step, V vocab, T max new tokens.

Each step takes the N beams' next-token logits and returns, for every new beam, the beam it
continues (to reorder the KV cache) and its token. Like transformers' vectorised beam search it
keeps the 2N best continuations of all beams (or samples 2N with `do_sample`), sends candidates
that end (EOS, stop string, length) among the top N to the finished set scored
sum_logprob / generated_len**length_penalty, continues with the N best unfinished ones, and stops
per `early_stopping` (True: N finished; False: HF's heuristic on the best running score).

With a grammar (structured output) every beam has its own matcher: before the candidates are
ranked, the tokens a beam's matcher forbids score FORBIDDEN (below every dead beam), so only
grammar-following continuations can be kept; a new beam takes a copy of its source beam's matcher
advanced by its token. Raw log-probabilities stay the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar import GrammarMatcher
from engine.sampling import SamplingConfig, apply_repetition_penalty, warp

NEG = -1.0e9
FORBIDDEN = 2 * NEG
"""The score a grammar-forbidden token adds: below the NEG of beams that are not live."""


@dataclass
class BeamHypothesis:
    """A finished beam: its new tokens, length-normalised score and raw log-probability sum."""

    token_ids: list[int]
    score: float
    logprob: float
    hit_stop_string: bool


class BeamSearch:
    """State of one request's beam search (N beams, up to T new tokens)."""

    def __init__(
        self,
        config: SamplingConfig,
        prompt_ids: list[int],
        eos_id: int | None,
        device: torch.device,
        generator: torch.Generator | None,
        matcher: GrammarMatcher | None = None,
    ) -> None:
        n, t = config.num_beams, config.max_new_tokens
        self.matchers: list[GrammarMatcher] | None = (
            None if matcher is None else [matcher] + [matcher.clone() for _ in range(n - 1)]
        )
        """Per running beam, its grammar state (None: no structured output)."""
        self.config = config
        self.num_beams = n
        self.eos_id = eos_id
        self.generator = generator
        self.prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        self.device = device
        self.generated = 0
        self.running_N_T = torch.zeros(n, t, dtype=torch.long, device=device)
        # Only beam 0 may be extended at the first step, so the N beams do not start identical.
        self.running_scores_N = torch.full((n,), NEG, device=device)
        self.running_scores_N[0] = 0.0
        self.running_raw_N = torch.zeros(n, device=device)
        self.finished_N_T = torch.zeros(n, t, dtype=torch.long, device=device)
        self.finished_len_N = torch.zeros(n, dtype=torch.long, device=device)
        self.finished_scores_N = torch.full((n,), NEG, device=device)
        self.finished_raw_N = torch.zeros(n, device=device)
        self.finished_stop_N = torch.zeros(n, dtype=torch.bool, device=device)
        self.is_finished_N = torch.zeros(n, dtype=torch.bool, device=device)
        self.improvable = True
        self.done = False

    def step(
        self, logits_NV: torch.Tensor, stop_check: Callable[[list[int]], bool] | None
    ) -> tuple[list[int], list[int]]:
        """Advance one token; returns (source beam of each new beam, its token).

        `stop_check(new_token_ids)` says whether a candidate's text contains a stop string.
        """
        cfg, n, g = self.config, self.num_beams, self.generated
        vocab = logits_NV.shape[-1]
        logprobs_NV = torch.log_softmax(logits_NV.float(), dim=-1)
        index_C, top_C = self._candidates(self._processed(logprobs_NV), vocab)
        keep = 2 * n
        beam_C, token_C = index_C // vocab, index_C % vocab
        raw_C = self.running_raw_N[beam_C] + logprobs_NV[beam_C, token_C]
        seqs_C_T = self.running_N_T[beam_C].clone()
        seqs_C_T[:, g] = token_C
        stop_C = torch.zeros(keep, dtype=torch.bool, device=self.device)
        if stop_check is not None:
            for c in range(keep):
                stop_C[c] = stop_check(seqs_C_T[c, : g + 1].tolist())
        hits_C = stop_C | (g + 1 >= cfg.max_new_tokens)
        if self.eos_id is not None:
            hits_C |= token_C == self.eos_id

        # Continue with the N best candidates that did not finish.
        running_C = top_C + hits_C.float() * NEG
        next_N = torch.topk(running_C, n).indices
        self.running_N_T = seqs_C_T[next_N]
        self.running_scores_N = running_C[next_N]
        self.running_raw_N = raw_C[next_N]
        self._merge_finished(top_C, hits_C, seqs_C_T, raw_C, stop_C)

        self.generated = g + 1
        self._update_done(hits_C)
        sources, tokens = beam_C[next_N].tolist(), token_C[next_N].tolist()
        if self.matchers is not None:
            self._advance_matchers(sources, tokens)
        return sources, tokens

    def _processed(self, logprobs_NV: torch.Tensor) -> torch.Tensor:
        """The log-probabilities with the grammar's mask, the repetition penalty and (when
        sampling) the warpers applied."""
        cfg, n, g = self.config, self.num_beams, self.generated
        vocab = logprobs_NV.shape[-1]
        processed_NV = logprobs_NV
        if self.matchers is not None:
            forbidden_NV = torch.from_numpy(
                ~np.stack([m.allowed(vocab) for m in self.matchers])
            ).to(self.device)
            processed_NV = processed_NV.masked_fill(forbidden_NV, FORBIDDEN)
        if cfg.repetition_penalty != 1.0:
            seen = [torch.cat([self.prompt, self.running_N_T[b, :g]]) for b in range(n)]
            processed_NV = apply_repetition_penalty(
                processed_NV, seen, [cfg.repetition_penalty] * n
            )
        if cfg.sampling:
            processed_NV = warp(processed_NV, [cfg] * n, min_keep=2)
        return processed_NV

    def _candidates(
        self, processed_NV: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index, accumulated score) of the 2N candidates: the best, or drawn when
        sampling, among those the grammar can still complete."""
        cfg, keep = self.config, 2 * self.num_beams
        while True:
            acc_flat = (processed_NV + self.running_scores_N[:, None]).reshape(-1)
            if cfg.sampling:
                index_C = torch.multinomial(acc_flat.softmax(-1), keep, generator=self.generator)
                top_C = acc_flat[index_C]
            else:
                top_C, index_C = torch.topk(acc_flat, keep)
            unfit = self._unfit(index_C, top_C, vocab)
            if not unfit:
                return index_C, top_C
            # A candidate after which the grammar could not complete within the tokens left
            # is forbidden like a token the grammar forbids, and the candidates are taken again
            # (only near the length limit; until then every candidate fits).
            processed_NV = processed_NV.clone()
            for beam, token in unfit:
                processed_NV[beam, token] = FORBIDDEN

    def _merge_finished(
        self,
        top_C: torch.Tensor,
        hits_C: torch.Tensor,
        seqs_C_T: torch.Tensor,
        raw_C: torch.Tensor,
        stop_C: torch.Tensor,
    ) -> None:
        """Finished candidates among the top N enter the finished set if they beat its worst."""
        cfg, n, g = self.config, self.num_beams, self.generated
        keep = 2 * n
        top_n_C = torch.arange(keep, device=self.device) < n
        just_finished_C = hits_C & top_n_C
        scores_C = top_C / float(g + 1) ** cfg.length_penalty
        if bool(self.is_finished_N.all()) and cfg.early_stopping:
            scores_C = scores_C + NEG
        if not self.improvable:
            scores_C = scores_C + NEG
        scores_C = scores_C + (~just_finished_C).float() * NEG
        merged_scores = torch.cat([self.finished_scores_N, scores_C])
        best_N = torch.topk(merged_scores, n).indices
        self.finished_N_T = torch.cat([self.finished_N_T, seqs_C_T])[best_N]
        new_len_C = torch.full((keep,), g + 1, dtype=torch.long, device=self.device)
        self.finished_len_N = torch.cat([self.finished_len_N, new_len_C])[best_N]
        self.finished_scores_N = merged_scores[best_N]
        self.finished_raw_N = torch.cat([self.finished_raw_N, raw_C])[best_N]
        self.finished_stop_N = torch.cat([self.finished_stop_N, stop_C])[best_N]
        self.is_finished_N = torch.cat([self.is_finished_N, just_finished_C])[best_N]

    def _advance_matchers(self, sources: list[int], tokens: list[int]) -> None:
        """Each new beam's grammar: its source beam's, advanced by its token."""
        assert self.matchers is not None
        live = (self.running_scores_N > NEG / 2).tolist()
        matchers = []
        for source, token, alive in zip(sources, tokens, live, strict=True):
            matcher = self.matchers[source].clone()
            if alive:  # a dead beam's token may break its grammar; it is never kept
                matcher.advance(token)
            matchers.append(matcher)
        self.matchers = matchers

    def _unfit(
        self, index_C: torch.Tensor, top_C: torch.Tensor, vocab: int
    ) -> list[tuple[int, int]]:
        """(beam, token) of the live, grammar-allowed candidates after which the beam's grammar
        has no plan within the tokens left (GrammarMatcher.fits); none without a grammar."""
        if self.matchers is None:
            return []
        left = self.config.max_new_tokens - self.generated
        unfit = []
        for index, score in zip(index_C.tolist(), top_C.tolist(), strict=True):
            beam, token = divmod(index, vocab)
            if score <= NEG / 2 or float(self.running_scores_N[beam]) <= NEG / 2:
                continue  # forbidden, or a dead beam's: never kept
            if not self.matchers[beam].fits(token, left):
                unfit.append((beam, token))
        return unfit

    def _update_done(self, hits_C: torch.Tensor) -> None:
        """HF's stopping rule: improvement still possible, open beams left, continuations left."""
        cfg = self.config
        best_possible = float(self.running_scores_N[0]) / float(self.generated) ** (
            cfg.length_penalty
        )
        all_finished = bool(self.is_finished_N.all())
        worst_finished = float(self.finished_scores_N.min()) if all_finished else NEG
        self.improvable = self.improvable and best_possible > worst_finished
        open_beams = not (all_finished and cfg.early_stopping)
        continuations = not bool(hits_C.all())
        self.done = not (self.improvable and open_beams and continuations)

    def results(self) -> list[BeamHypothesis]:
        """The best `num_return_sequences` finished hypotheses, best first."""
        out = []
        for b in range(self.config.num_return_sequences):
            length = int(self.finished_len_N[b])
            out.append(
                BeamHypothesis(
                    token_ids=self.finished_N_T[b, :length].tolist(),
                    score=float(self.finished_scores_N[b]),
                    logprob=float(self.finished_raw_N[b]),
                    hit_stop_string=bool(self.finished_stop_N[b]),
                )
            )
        return out
