"""PackedLinear (oneDNN-packed weights for inference) against its reference, F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(nn.Linear(2, 2)), reason="this torch build has no oneDNN linear prepacking"
)


@pytest.mark.parametrize("gemv_copy", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [(1, 1), (1,), (3, 1), (2, 17), (64,)])
def test_matches_f_linear(bias, rows, gemv_copy):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(*rows, 96)
    expected = linear(x)
    packed = PackedLinear(linear, gemv_copy=gemv_copy)
    assert (packed.gemv_weight is not None) == gemv_copy
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == expected.shape
    # Same products, another summation order: fp32 rounding only.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert tuple(packed.weight.shape) == (160, 96)


def test_pack_linears_swaps_plain_linears_and_skips_the_rest():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4).double())
    model[2].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 8)
    expected = model[:3](x)
    replaced = pack_linears(model, skip=("0",))
    assert replaced == []  # "0" skipped, "2" has a hook, "3" is fp64
    model2 = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model2.load_state_dict(model[:3].state_dict())
    assert pack_linears(model2) == ["0", "2"]
    assert isinstance(model2[0], PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(model2(x) * 2, expected, atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="keep it as it is"):
        PackedLinear(nn.Linear(4, 4).double())


def test_compiled_graph_calls_the_packed_op():
    """Inside torch.compile the packed weight runs through meshline::packed_linear (inductor
    lowers oneDNN's linear only on weights it packed itself): same result as F.linear, for the
    gemv copy's single row and the packed weight's several rows alike."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    compiled = torch.compile(PackedLinear(linear, gemv_copy=True), fullgraph=True)
    for rows in [(1, 1), (3, 1), (5, 1)]:
        x = torch.randn(*rows, 96)
        with torch.inference_mode():
            out = compiled(x)
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
