"""The candidate/checker split keeps HumanEval's semantics for honest code.

Values cross the boundary exactly (tuple stays tuple, dict keys keep their types, floats keep
every bit, NaN included), malformed messages are refused, and problems shaped like HumanEval's
trickier ones (a tuple result, a dict result, a float tolerance, helpers from the prompt used by
the test, an exception expected from the candidate) pass with right answers and fail with
wrong ones.
"""

from __future__ import annotations

import importlib.util
import io
import math
from collections import Counter, OrderedDict, namedtuple

import pytest

from services.evaluator.sandbox.runner import Check, isolation, run_check
from services.evaluator.sandbox.runs import HERE

# The sandbox imports wire.py as a top-level module; so does this test (without touching sys.path).
_spec = importlib.util.spec_from_file_location("sandbox_wire", HERE / "wire.py")
wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wire)

Pair = namedtuple("Pair", "a b")
VALUES = [
    None, True, False, 0, -(2**100), 1.5, -0.0, float("inf"), 1e-310, 3 + 4j, "", "é\ud800",
    b"\x00\xff", [], [1, [2, (3,)]], (), (1, "a"), {"a": 1}, {(1, 2): {3}, 4: frozenset({5})},
    {1, 2, 3}, frozenset(), [{"x": [None, (True,)]}],
]  # fmt: skip


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_round_trip_exactly(value):
    line = wire.dumps({"ok": wire.encode(value)})
    back = wire.decode(wire.read_message(io.BytesIO(line))["ok"])
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)


def test_nan_and_subclasses_arrive_as_plain_values():
    (back,) = wire.decode(wire.encode([float("nan")]))
    assert math.isnan(back)
    assert type(wire.decode(wire.encode(Counter("aab")))) is dict
    assert wire.decode(wire.encode(Pair(1, 2))) == (1, 2)
    assert type(wire.decode(wire.encode(OrderedDict(a=1)))) is dict

    class Int(int):
        def __eq__(self, other):
            return True

    assert type(wire.decode(wire.encode(Int(3)))) is int


@pytest.mark.parametrize(
    "bad",
    [b'{"ok": {"t": 1}}\n', b'{"ok": {"x": 1.0}}\n', b'{"ok": {"q": []}}\n', b'{"ok": NaN}\n',
     b"[1]\n", b'{"ok": {"d": [[1]]}}\n', b'{"ok": {"s": [[1]]}}\n', b'{"ok": 1}'],
)  # fmt: skip
def test_malformed_messages_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        wire.decode(wire.read_message(io.BytesIO(bad))["ok"])


def test_objects_that_are_not_data_do_not_cross():
    for value in (object(), lambda: 1, iter([1]), type):
        with pytest.raises(TypeError):
            wire.encode(value)


PROBLEMS = {
    "tuple_result": (
        "from typing import List, Tuple\n\n\ndef sum_product(numbers: List[int]) -> Tuple[int, int]:\n"
        '    """(sum, product) of numbers."""\n',
        "    s, p = 0, 1\n    for n in numbers:\n        s += n\n        p *= n\n    return s, p\n",
        "    return [sum(numbers), 1]\n",
        "def check(candidate):\n    assert candidate([]) == (0, 1)\n    assert candidate([1, 2, 4]) == (7, 8)\n",
        "sum_product",
    ),
    "dict_result": (
        'def histogram(test):\n    """Letters with the highest count."""\n',
        "    from collections import Counter\n    c = Counter(test.split())\n    if not c:\n"
        "        return {}\n    m = max(c.values())\n    return {k: v for k, v in c.items() if v == m}\n",
        "    return {}\n",
        "def check(candidate):\n    assert candidate('a b b a') == {'a': 2, 'b': 2}\n"
        "    assert candidate('') == {}\n",
        "histogram",
    ),
    "float_tolerance_and_prompt_helper": (
        "import math\n\n\ndef poly(xs: list, x: float):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\n"
        'def find_zero(xs: list):\n    """A zero of poly(xs)."""\n',
        "    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n        lo *= 2.0\n        hi *= 2.0\n"
        "    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2.0\n"
        "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n            hi = mid\n"
        "    return lo\n",
        "    return 0.5\n",
        "def check(candidate):\n    import copy, math, random\n    rng = random.Random(42)\n"
        "    for _ in range(50):\n        coeffs = [rng.choice([1, 2, 3]) for _ in range(2 * rng.randint(1, 3))]\n"
        "        solution = candidate(copy.deepcopy(coeffs))\n        assert math.fabs(poly(coeffs, solution)) < 1e-4\n",
        "find_zero",
    ),
    "expected_exception": (
        'def checked_div(a, b):\n    """a / b; ValueError when b is 0."""\n',
        "    if b == 0:\n        raise ValueError('b is 0')\n    return a / b\n",
        "    return a / b\n",
        "def check(candidate):\n    assert candidate(1, 4) == 0.25\n    try:\n        candidate(1, 0)\n"
        "    except ValueError:\n        pass\n    else:\n        raise AssertionError('no ValueError')\n",
        "checked_div",
    ),
}  # fmt: skip


@pytest.mark.skipif(not isolation().available, reason=f"no namespaces: {isolation().reason}")
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_humaneval_shaped_problems_keep_their_semantics(name):
    prompt, right, wrong, test, entry = PROBLEMS[name]
    assert run_check(Check(prompt, right, test, entry)).passed
    assert not run_check(Check(prompt, wrong, test, entry)).passed
