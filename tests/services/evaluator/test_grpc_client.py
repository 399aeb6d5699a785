"""How `GrpcLanguageModel` packs log-likelihood requests into `Score` calls.

The server runs a context once per call for every item of that call sharing it, so a question's
choices must not be split across calls; repeated items go out once. Answers come back in request
order, equal to scoring each item in a call of its own.
"""

from __future__ import annotations

import math

import grpc
import pytest

from services.evaluator.models.base import GenerationRequest
from services.evaluator.models.grpc_client import GrpcLanguageModel
from tests.security.fake_inference import serve_fake


class RecordScoreCalls(grpc.UnaryUnaryClientInterceptor):
    """Keeps the (context, continuation) ids of every item of every Score request sent."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []

    def intercept_unary_unary(self, continuation, client_call_details, request):
        if client_call_details.method.endswith("/Score"):
            self.calls.append(
                [
                    (tuple(i.context_token_ids), tuple(i.continuation_token_ids))
                    for i in request.items
                ]
            )
        return continuation(client_call_details, request)


def test_choices_sharing_a_context_go_in_one_score_call(served):
    _, server = served
    recorder = RecordScoreCalls()
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), recorder)
    model = GrpcLanguageModel(server.address, batch_size=8, channel=channel)
    # Three 5-choice questions (AGIEval LSAT-AR's shape): in request order, 8-item calls would
    # cut the second question across two calls. The first question is asked twice.
    questions = [[10 + q, 20 + q, 30 + q, 40] for q in range(3)]
    items = [(q, [50 + c, 60 + c]) for q in questions for c in range(5)]
    items += items[:5]
    scores = model.score_ids(items)

    sent = [item for call in recorder.calls for item in call]
    assert len(sent) == len(set(sent)) == 15
    assert all(len(call) <= 8 for call in recorder.calls)
    calls_per_context = {
        tuple(q): sum(any(c == tuple(q) for c, _ in call) for call in recorder.calls)
        for q in questions
    }
    assert calls_per_context == {tuple(q): 1 for q in questions}
    one_by_one = GrpcLanguageModel(server.address, batch_size=1)
    for (lp, greedy), (lp_alone, greedy_alone) in zip(
        scores, one_by_one.score_ids(items), strict=True
    ):
        assert math.isclose(lp, lp_alone, abs_tol=1e-4) and greedy == greedy_alone
    model.close()
    one_by_one.close()


def test_add_bos_token_sets_what_contexts_are_scored_after(served):
    """`--add-bos-token` (lm-eval's add_bos_token): unset follows the tokenizer (this fixture's
    sentencepiece model puts BOS first), false scores the text alone, true puts BOS first; a
    context already starting with the BOS text is never given a second one."""
    from services.evaluator.cli import build_parser, open_model

    _, server = served
    recorder = RecordScoreCalls()
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), recorder)
    sent = {}
    for setting in (None, False, True):
        model = GrpcLanguageModel(server.address, channel=channel, add_bos_token=setting)
        bos = model.special_tokens.bos_id
        assert (bos, model.special_tokens.bos_text) == (1, "<s>")
        plain = model.tokenize(["Question: is the sun a star?"], add_special_tokens=False)[0]
        recorder.calls.clear()
        model.loglikelihood([("Question: is the sun a star?", " yes"), ("<s>Q:", " no")])
        (first, second), *_ = recorder.calls
        sent[setting] = first[0]
        assert first[0] == ((bos, *plain) if setting is not False else tuple(plain))
        assert second[0].count(bos) == 1 and second[0][0] == bos
    assert sent[None] == sent[True] != sent[False]
    args = build_parser().parse_args(["--endpoint", server.address, "--add-bos-token", "false"])
    assert open_model(args).add_bos_token is False


def test_no_bos_or_eos_fails_only_an_empty_context():
    """lm-eval needs the prefix token (BOS, else EOS) only to score an empty context: generation
    and non-empty contexts run on a tokenizer with neither, an empty context is refused by name."""
    inference, fake = serve_fake(lambda prompt: f"<{prompt}>")
    model = GrpcLanguageModel(inference.address)
    try:
        assert model.special_tokens.prefix_id is None
        request = GenerationRequest(context="ab", until=(), max_new_tokens=4)
        assert model.generate_until([request]) == ["<ab>"]
        assert fake.generated == 1
        with pytest.raises(ValueError, match=rf"--endpoint {inference.address}: .*empty context"):
            model.loglikelihood([("", "x")])
    finally:
        model.close()
        inference.stop()
