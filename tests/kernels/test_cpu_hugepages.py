"""kernels.cpu.hugepages: a served model's large CPU weights move into one mapping the kernel
may back with 2 MiB pages; values, Parameter objects and tied weights are unchanged."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from kernels.cpu import hugepages
from kernels.cpu.hugepages import HUGE_PAGE, move_to_huge_pages, thp_mode
from models import build_model
from models.registry import get_config

needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
    reason=f"transparent huge pages are {thp_mode() or 'not available'} on this system",
)


def _model(tie: bool = False) -> nn.Module:
    """A small Llama whose embedding and head are 2 MiB each (4096 x 128 fp32)."""
    torch.manual_seed(0)
    config = get_config(
        "tiny-llama-gqa",
        vocab_size=4096,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=352,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return build_model(config, device="cpu").eval()


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its fields by name."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
                if inside:
                    fields = {"range": head}
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


@needs_thp
def test_large_weights_move_into_one_advised_mapping_unchanged():
    model = _model()
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before_logits = model(ids)
    params = dict(model.named_parameters())
    large = {n for n, p in params.items() if p.numel() * p.element_size() >= HUGE_PAGE}
    assert large == {"embed_tokens.weight", "lm_head.weight"}
    values = {n: p.detach().clone() for n, p in params.items()}
    small_ptrs = {n: p.data_ptr() for n, p in params.items() if n not in large}

    moved = move_to_huge_pages(model)

    assert moved.tensors == len(large)
    assert moved.nbytes == sum(params[n].numel() * 4 for n in large)
    assert "transparent huge pages" in moved.why
    after = dict(model.named_parameters())
    assert all(after[n] is params[n] for n in params)  # the same Parameter objects
    for name, param in after.items():
        assert torch.equal(param, values[name]), name
        assert param.is_contiguous() and param.dtype == torch.float32
    assert {n: after[n].data_ptr() for n in small_ptrs} == small_ptrs
    maps = {_mapping(after[n].data_ptr())["range"] for n in large}
    assert len(maps) == 1, maps
    entry = _mapping(after[sorted(large)[0]].data_ptr())
    assert "hg" in entry.get("VmFlags", "").split(), entry  # advised MADV_HUGEPAGE
    if "THPeligible" in entry:
        assert entry["THPeligible"] == "1", entry
    with torch.no_grad():
        assert torch.equal(model(ids), before_logits)
    # Moved tensors share one storage now: a second call finds nothing to move.
    assert move_to_huge_pages(model).tensors == 0


@needs_thp
def test_tied_weights_stay_one_tensor():
    model = _model(tie=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    moved = move_to_huge_pages(model)
    assert moved.tensors == 1  # one Parameter, moved once
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "hg" in _mapping(model.lm_head.weight.data_ptr())["VmFlags"].split()


def test_views_and_small_tensors_stay_where_they_are():
    whole = torch.randn(2 * HUGE_PAGE // 4)
    holder = nn.Module()
    holder.view = nn.Parameter(whole[: HUGE_PAGE // 4])  # shares a larger storage
    holder.small = nn.Parameter(torch.randn(1000))

    class Wrapped(torch.Tensor):  # a tensor subclass (DTensor is one): left alone
        pass

    holder.register_buffer("wrapped", torch.randn(HUGE_PAGE // 4).as_subclass(Wrapped))
    held = [holder.view, holder.small, holder.wrapped]
    pointers = [t.data_ptr() for t in held]
    moved = move_to_huge_pages(holder)
    assert moved.tensors == 0 and moved.nbytes == 0
    assert [t.data_ptr() for t in held] == pointers


def test_without_transparent_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda path=None: "never")
    model = _model()
    pointer = model.lm_head.weight.data_ptr()
    moved = move_to_huge_pages(model)
    assert moved.tensors == 0
    assert "4 KiB pages" in moved.why and "never" in moved.why
    assert model.lm_head.weight.data_ptr() == pointer


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise"
    setting.write_text("[never]\n")
    assert thp_mode(setting) == "never"
    assert thp_mode(tmp_path / "missing") == ""


@needs_thp
def test_a_column_major_weight_keeps_its_layout():
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(1024, 1024).t().contiguous().t())  # [O, I] col-major
    value = holder.weight.detach().clone()
    strides = holder.weight.stride()
    assert move_to_huge_pages(holder).tensors == 1
    assert holder.weight.stride() == strides == (1, 1024)
    assert torch.equal(holder.weight, value)
    assert "hg" in _mapping(holder.weight.data_ptr())["VmFlags"].split()
