"""Writes real DeepSpeed ZeRO checkpoints (DeepSpeed's own `save_checkpoint`) for the converter tests.

Run as one rank of a gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the caller):
`python -m tests.services.converter.deepspeed_writer OUT`. On DeepSpeed's CPU accelerator
(DS_ACCELERATOR=cpu) each case builds its tiny model, trains two steps with a torch AdamW (`torch_adam`:
no JIT build of DeepSpeed's CPUAdam, minutes on a busy machine, for the offload case), saves `OUT/<case>/` (`latest`,
`global_step2/`, the model's HF `config.json`; the universal cases also `OUT/<case>-universal/`
from deepspeed's `ds_to_universal` tool) and, on rank 0, `OUT/<case>/expected.safetensors`:
every parameter's full fp32 master value as DeepSpeed's engine holds it after the last step
(`deepspeed.utils.safe_get_full_fp32_param`), independent of the checkpoint files.
`write_all` launches the ranks as subprocesses.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[3]
WORLD = 2
STEPS = 2
VOCAB = 203


def llama() -> Any:
    """Sizes that are not multiples of 4 (54 hidden, 50 ffn, 203 vocab), so ZeRO pads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=54,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return _randomise(LlamaForCausalLM(config), seed=3)


def bloom() -> Any:
    """Odd sizes (45 hidden: norms and biases of odd length) and a tied output head."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=VOCAB, hidden_size=45, n_layer=2, n_head=3)
    return _randomise(BloomForCausalLM(config), seed=4)


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@dataclass(frozen=True)
class Case:
    """One checkpoint DeepSpeed writes."""

    family: str
    """llama or bloom (tied head)."""
    zero: dict[str, Any]
    """The `zero_optimization` block."""
    bf16: bool = False
    """Train in bf16 (DeepSpeed keeps fp32 master weights in the optimizer)."""
    frozen: tuple[str, ...] = ()
    """Parameters with requires_grad False (not owned by the optimizer)."""
    universal: bool = False
    """Also convert to a universal checkpoint with deepspeed's ds_to_universal tool."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More top-level config keys."""


CASES: dict[str, Case] = {
    "zero2": Case("llama", {"stage": 2}, universal=True),
    "zero2-bf16-roundrobin-frozen": Case(
        "llama",
        {"stage": 2, "round_robin_gradients": True},
        bf16=True,
        frozen=("model.embed_tokens.weight",),
    ),
    "zero2-offload": Case("llama", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "zero1-bf16": Case("llama", {"stage": 1}, bf16=True),
    "zero3-tied": Case("bloom", {"stage": 3}, universal=True),
    "zero3-subgroups-frozen": Case(
        "llama", {"stage": 3, "sub_group_size": 6000}, frozen=("model.norm.weight",)
    ),
}


def _config(case: Case) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": case.zero,
        "bf16": {"enabled": case.bf16},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        **case.extra,
    }


def _write_case(name: str, case: Case, out: Path, rank: int) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    model = llama() if case.family == "llama" else bloom()
    for param_name, param in model.named_parameters():
        param.requires_grad_(param_name not in case.frozen)
    directory = out / name
    if rank == 0:
        directory.mkdir(parents=True)
        model.config.save_pretrained(directory)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_config(case),
    )
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(directory))  # as HF Trainer saves: no client state
    full: dict[int, torch.Tensor] = {}
    for param in engine.module.parameters():  # collective: every rank takes part
        value = safe_get_full_fp32_param(param) if param.requires_grad else None
        if value is None:  # frozen: the module's own (gathered under ZeRO-3) value
            with deepspeed.zero.GatheredParameters([param]):
                value = param.detach().float()
        full[id(param)] = value.detach().clone().float()
    if rank == 0:
        expected = {
            n: full[id(p)].clone()
            for n, p in engine.module.named_parameters(remove_duplicate=False)
        }
        save_file(expected, str(directory / "expected.safetensors"))
    engine.destroy()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_all(out: Path, timeout: float = 600.0) -> None:
    """Runs WORLD ranks of this module (gloo on localhost) writing every case under `out`;
    then the universal conversions. RuntimeError with the ranks' output when one fails."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "PYTHONPATH": path,  # the ranks import this tree, whatever the caller's directory
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(WORLD),
        "LOCAL_SIZE": str(WORLD),
    }
    procs = []
    for rank in range(WORLD):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        command = [sys.executable, "-m", "tests.services.converter.deepspeed_writer", str(out)]
        proc = subprocess.Popen(command, env=rank_env, stdout=log, stderr=log, cwd=REPO)
        procs.append((proc, log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        if code != 0:
            failed.append(rank)
    if failed:
        tail = (out / f"rank{failed[0]}.log").read_text()[-4000:]
        raise RuntimeError(f"DeepSpeed ranks {failed} failed:\n{tail}")
    for name, case in CASES.items():
        if case.universal:  # OUT/<case>-universal/{latest_universal, config.json, global_stepN/}
            universal = out / f"{name}-universal"
            universal.mkdir()
            shutil.copy2(out / name / "config.json", universal / "config.json")
            command = [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(out / name / f"global_step{STEPS}"),
                "--output_folder", str(universal / f"global_step{STEPS}"),
                "--num_extract_workers", "1", "--num_merge_workers", "1",
                "--inject_missing_state",  # ZeRO-1/2 saves lack universal_checkpoint_info
            ]  # fmt: skip
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=timeout)


def main(argv: list[str]) -> int:
    rank = int(os.environ["RANK"])
    out = Path(argv[0])
    for name, case in CASES.items():
        _write_case(name, case, out, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
