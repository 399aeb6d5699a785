"""The real SmolLM2-135M-Instruct through the user's whole pipeline, against transformers (#36).

Every step is the `meshline` command a user runs, as a subprocess (servers on localhost ports):
`meshline convert` HF -> native; `meshline serve inference` of the native checkpoint (gRPC and
the OpenAI HTTP front), whose greedy answers to a text prompt and a chat equal HF `generate`;
`meshline evaluate` on BoolQ items against that server, whose log-likelihoods equal lm-eval's
`HFLM` around the transformers model; `meshline preprocess` of a few alpaca records and
`meshline train` of a LoRA from the native checkpoint; `meshline convert --merge-lora` to HF,
whose logits equal peft's `PeftModel` with the exported adapter on the HF base; and the merged
model served, greedy equal to HF `generate` on the merged weights.

The model is the session's `smollm2_dir` (the GGUF dequantized by transformers, built once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshline.inference.v1 import inference_pb2 as pb
from tests.fixtures import records as fx
from tests.served_process import GRPC_PORT, HTTP_PORT, Launched, launched
from tests.services.evaluator.lm_eval_ref import FIXTURES

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # four conversions/trainings and two servers of a 135M model

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
READY = {"grpc": GRPC_PORT, "http": HTTP_PORT}
SMOLLM2_FLAGS = [
    "--num-layers", "30", "--hidden-size", "576", "--ffn-hidden-size", "1536",
    "--num-attention-heads", "9", "--group-query-attention", "--num-query-groups", "3",
    "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
    "--position-embedding-type", "rope", "--rotary-base", "100000", "--disable-bias-linear",
    "--max-position-embeddings", "8192",
]  # fmt: skip
"""SmolLM2's architecture as Megatron flags (tied embeddings are Megatron's default)."""


def _meshline() -> list[str]:
    """The `meshline` console script beside this interpreter (what users run), else its entry."""
    script = Path(sys.executable).with_name("meshline")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from services.cli import main; sys.exit(main())"]


def _env() -> dict[str, str]:
    """This checkout first on the path, so the subprocesses run the code under test."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def meshline(*argv: str, timeout: float = 300) -> str:
    """Run `meshline ARGV` to completion; its output, or a failure showing the output's tail."""
    done = subprocess.run(
        [*_meshline(), *argv],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"meshline {' '.join(argv)}\n{done.stdout[-4000:]}"
    return done.stdout


@dataclass
class Server:
    """A `meshline serve inference` process with its gRPC and HTTP ports."""

    launched: Launched
    """The process, its output and announced ports."""

    @property
    def lines(self) -> list[str]:
        """Its output so far."""
        return self.launched.lines

    @property
    def grpc_port(self) -> int:
        """gRPC port."""
        return self.launched.ports["grpc"]

    @property
    def http_port(self) -> int:
        """OpenAI HTTP port."""
        return self.launched.ports["http"]

    def stub(self):
        """An InferenceService stub on the gRPC port."""
        import grpc

        from meshline.inference.v1 import inference_pb2_grpc as pb_grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return pb_grpc.InferenceServiceStub(channel)

    def client(self):
        """The `openai` client on the HTTP front."""
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1",
            api_key="unused",
            max_retries=0,
        )


@contextmanager
def serve(load: Path, load_format: str) -> Iterator[Server]:
    """`meshline serve inference` of `load` for a `with` block (then SIGTERM, then kill)."""
    command = [*_meshline(), "serve", "inference", "--port", "0", "--http-port", "0"]
    command += ["--load", str(load), "--load-format", load_format, "--served-model-name", "smol"]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--max-batch-rows", "2"]
    command += ["--grace-period", "5"]
    with launched(command, READY, env=_env()) as process:
        yield Server(process)


def hf_greedy(model, ids: list[int]) -> list[int]:
    """HF's greedy new tokens, stopping at SmolLM2's EOS (`<|im_end|>`)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.eos_token_id,
            top_k=None,
            top_p=None,
            temperature=None,
            repetition_penalty=None,
        )
    return out[0, len(ids) :].tolist()


def chat_ids(tokenizer, messages) -> list[int]:
    """The chat's prompt ids through the tokenizer's own template."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def load_hf(directory: Path):
    """(model, tokenizer) of an HF directory, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def hf_base(smollm2_dir):
    """transformers' SmolLM2 and tokenizer on the fixture's weights."""
    return load_hf(smollm2_dir)


@pytest.fixture(scope="module")
def native(smollm2_dir, tmp_path_factory) -> Path:
    """`meshline convert` HF -> native (verified by default)."""
    out = tmp_path_factory.mktemp("smollm2-pipeline") / "native"
    log = meshline(
        "convert", "--load-format", "hf", "--save-format", "native",
        "--load-dir", str(smollm2_dir), "--save-dir", str(out),
    )  # fmt: skip
    assert "verify: max |logit difference|" in log and "(passed)" in log, log[-2000:]
    return out


@pytest.fixture(scope="module")
def served_native(native) -> Iterator[Server]:
    """The native checkpoint served (gRPC + OpenAI HTTP) for the module."""
    with serve(native, "native") as server:
        yield server


def check_greedy(server: Server, model, tokenizer) -> None:
    """gRPC Generate of PROMPT and the OpenAI chat of CHAT equal HF `generate` on `model`."""
    import grpc

    expected = hf_greedy(model, tokenizer.encode(PROMPT))
    try:
        reply = server.stub().Generate(
            pb.GenerateRequest(prompt=PROMPT, params=pb.SamplingParams(max_new_tokens=NEW_TOKENS)),
            timeout=120,
        )
    except grpc.RpcError as exc:  # the server's log says why
        raise AssertionError(f"{exc}\n--- server log ---\n{''.join(server.lines[-80:])}") from exc
    assert list(reply.sequences[0].token_ids) == expected
    ids = chat_ids(tokenizer, CHAT)
    expected_chat = hf_greedy(model, ids)
    out = server.client().chat.completions.create(
        model="smol", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected_chat)
    assert out.choices[0].message.content == tokenizer.decode(
        expected_chat, skip_special_tokens=True
    )


def test_served_native_checkpoint_equals_hf_generate(served_native, hf_base):
    model, tokenizer = hf_base
    info = served_native.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.context_length == MAX_MODEL_LEN  # --max-model-len, not the model's 8192
    check_greedy(served_native, model, tokenizer)


def test_evaluate_against_the_server_equals_lm_evals_hf_model(served_native, hf_base, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    meshline(
        "evaluate", "--tasks", "boolq", "--task-data-path", str(FIXTURES),
        "--endpoint", f"127.0.0.1:{served_native.grpc_port}", "--output-path", str(tmp_path),
        "--limit", "3", "--no-progress",
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    assert "boolq" in results["results"]
    samples = [
        json.loads(line) for line in (tmp_path / "samples_boolq.jsonl").read_text().splitlines()
    ]
    pairs = [tuple(args) for sample in samples for args in sample["arguments"]]
    assert len(samples) == 3 and len(pairs) == 6  # " no" and " yes" per item
    model, tokenizer = hf_base
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=MAX_MODEL_LEN)
    theirs = reference.loglikelihood(
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True
    )
    ours = [tuple(r) for sample in samples for r in sample["resps"]]
    for pair, (lp, greedy), (ref_lp, ref_greedy) in zip(pairs, ours, theirs, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3), pair
        assert bool(greedy) == bool(ref_greedy), pair
    # The accuracy is the one these log-likelihoods decide (lm-eval's BoolQ choices: no, yes).
    right = [
        max((0, 1), key=lambda c, s=sample: s["resps"][c][0]) == int(sample["doc"]["answer"])
        for sample in samples
    ]
    assert results["results"]["boolq"]["acc,none"] == pytest.approx(sum(right) / len(right))


def test_lora_finetune_merge_and_serve_equal_peft_and_hf(native, smollm2_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    data = fx.write_json_array(tmp_path / "alpaca.json", fx.ALPACA)
    prefix = tmp_path / "alpaca"
    meshline(
        "preprocess", "--input", str(data), "--output-prefix", str(prefix),
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(smollm2_dir),
        "--handler-name", "alpaca",
    )  # fmt: skip
    save = tmp_path / "lora"
    meshline(
        "train", *SMOLLM2_FLAGS, "--seq-length", "64", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--data-path", str(prefix), "--split", "1,0,0",
        "--is-instruction-dataset", "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", str(smollm2_dir), "--load", str(native), "--finetune",
        "--train-iters", "2", "--lr", "1e-2", "--eval-interval", "0", "--log-interval", "1",
        "--lora-target-modules", "query_key_value", "dense", "--lora-r", "4", "--lora-alpha", "8",
        "--save", str(save), "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    adapter = save / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4

    merged_dir = tmp_path / "merged"
    log = meshline(
        "convert", "--load-format", "native", "--save-format", "hf", "--load-dir", str(native),
        "--save-dir", str(merged_dir), "--lora-load", str(adapter), "--merge-lora",
    )  # fmt: skip
    assert "(passed)" in log, log[-2000:]
    merged, tokenizer = load_hf(merged_dir)
    base = load_file(smollm2_dir / "model.safetensors")
    changed = [
        name for name, tensor in load_file(merged_dir / "model.safetensors").items()
        if not torch.equal(tensor, base[name])
    ]  # fmt: skip
    # Two steps of a LoRA on the attention's projections move exactly those weights.
    assert changed and all(re.search(r"self_attn\.[qkvo]_proj\.weight$", n) for n in changed)

    # peft's forward with the exported adapter on the HF base equals the merged weights' logits.
    base_model, _ = load_hf(smollm2_dir)
    with_adapter = PeftModel.from_pretrained(base_model, str(adapter)).eval()
    ids = torch.tensor([chat_ids(tokenizer, CHAT) + tokenizer.encode(PROMPT)])
    with torch.no_grad():
        theirs = with_adapter(ids).logits
        ours = merged(ids).logits
        untouched = with_adapter.get_base_model()
        with with_adapter.disable_adapter():
            base_logits = untouched(ids).logits
    del with_adapter, base_model
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert (ours - base_logits).abs().max() > 1e-3  # the adapter is not a no-op

    with serve(merged_dir, "hf") as server:
        check_greedy(server, merged, tokenizer)
