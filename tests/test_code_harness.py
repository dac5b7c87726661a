"""Issue #37: the values that cross between the tests' process and the program's (harness.encode/decode),
and the copy back of mutated arguments. No sandbox: plain functions."""

from __future__ import annotations

import collections
import json
import math
import time
from decimal import Decimal
from fractions import Fraction

import pytest

from grpo_variants.rewards import harness


def _refuse(v):
    raise TypeError("not plain data")


def _cross(v):
    return harness.decode(json.loads(json.dumps(harness.encode(v, _refuse))), lambda i: ("handle", i))


VALUES = [
    None, True, False, 0, -7, 10 ** 5000, -(10 ** 400), (1 << 62), 1.5, -0.0, float("inf"), complex(1, -2),
    "", "héllo\n", b"\x00\xff", bytearray(b"ab"), (), (1, (2, "x")), [1, [2, [3]]], {1, 2.5, "a"},
    frozenset({(1, 2)}), {"a": [1], 2: {3: 4}}, collections.OrderedDict([("b", 1), ("a", 2)]),
    collections.defaultdict(list, {"k": [1]}), collections.Counter("abracadabra"),
    collections.deque([1, 2, 3], maxlen=5), Fraction(22, 7), Decimal("3.14159265358979323846"), range(2, 20, 3),
    {(1, 2): frozenset({3})},
]


@pytest.mark.parametrize("v", VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(VALUES)])
def test_every_type_a_test_compares_crosses_unchanged(v):
    out = _cross(v)
    assert type(out) is type(v) and out == v
    if isinstance(v, collections.OrderedDict):
        assert list(out) == list(v)
    if isinstance(v, collections.defaultdict):
        assert out.default_factory is list and out["new"] == []
    if isinstance(v, collections.deque):
        assert out.maxlen == v.maxlen


def test_nan_views_and_subclasses():
    assert math.isnan(_cross(float("nan")))
    d = {"a": 1, "b": 2}
    assert _cross(d.keys()) == {"a", "b"} and type(_cross(d.keys())) is type(d.keys())
    assert list(_cross(d.values())) == [1, 2] and _cross(d.items()) == {("a", 1), ("b", 2)}

    class MyInt(int):
        def __eq__(self, other):  # a program's always-equal int arrives as the plain int it holds
            return True

    assert type(_cross(MyInt(3))) is int and _cross(MyInt(3)) != 4


def test_a_program_object_is_a_handle_not_a_value():
    class Node:
        pass

    objs = []

    def handle(v):
        objs.append(v)
        return {"h": len(objs) - 1}

    out = harness.decode(json.loads(json.dumps(harness.encode([Node(), 1], handle))), lambda i: ("handle", i))
    assert out == [("handle", 0), 1] and isinstance(objs[0], Node)


@pytest.mark.parametrize("bad", [
    '{"t": 1}', '{"s": [[1], [2]]}', '{"d": [[{"d": []}, 1]]}', '{"b": "zz"}', '{"zz": 1}', '{"a": 1, "b": 2}',
    '{"F": [1, 0]}', '{"r": [1, 2, 0]}', '{"q": [[1], -1]}', '{"i": "xyz"}', '{"c": [1]}',
])
def test_malformed_values_raise_never_hang(bad):
    with pytest.raises(Exception):
        harness.decode(json.loads(bad), lambda i: i)


def test_decoding_is_bounded():
    deep = [[]]
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError):
        harness.encode(deep, _refuse)
    with pytest.raises(ValueError):
        harness.decode(json.loads(json.dumps(deep)), lambda i: i)
    with pytest.raises(ValueError):
        harness.decode([[]] * (harness.MAX_ELEMENTS + 1), lambda i: i)
    mod = (1 << 61) - 1  # 39,000 integers that hash alike: refused in linear time, not built quadratically
    t = time.process_time()
    with pytest.raises(ValueError):
        harness.decode({"s": [k * mod for k in range(39_000)]}, lambda i: i)
    assert time.process_time() - t < 3.0
    with pytest.raises(ValueError):
        harness.decode({"i": "f" * 200_000}, lambda i: i)


def test_mutated_arguments_are_copied_back_in_place():
    inner = [3, 1]
    data = [inner, {"k": [1]}, {1}]
    alias = data[1]
    harness.copy_into(data, [[1, 3], {"k": [1, 2], "n": 0}, {1, 2}])
    assert data == [[1, 3], {"k": [1, 2], "n": 0}, {1, 2}]
    assert data[0] is inner and data[1] is alias  # the test's other names for them see the change
    t = ([2, 1], 5)
    harness.copy_into(t, ([1, 2], 5))
    assert t[0] == [1, 2]
