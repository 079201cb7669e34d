"""The indexed heap against a plain sorted list, under random pushes, re-keys and removals."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.core.schedulers.heap import KeyedHeap

ops = st.lists(
    st.tuples(st.sampled_from(["set", "discard"]), st.integers(0, 15), st.integers(-50, 50)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, avoid=st.sets(st.integers(0, 15), max_size=3))
def test_min_matches_a_sorted_reference(ops, avoid):
    heap = KeyedHeap()
    reference: dict[int, tuple[int, int]] = {}
    for op, item, key in ops:
        if op == "set":
            heap.set(item, (key, item))
            reference[item] = (key, item)
        else:
            heap.discard(item)
            reference.pop(item, None)
        expected = min(reference, key=reference.__getitem__) if reference else None
        assert heap.min() == expected
        assert len(heap) == len(reference)
    allowed = {i: k for i, k in reference.items() if i not in avoid}
    expected = min(allowed, key=allowed.__getitem__) if allowed else None
    assert heap.min(avoid) == expected
    assert sorted(heap.items()) == sorted(reference)  # avoided items were put back
    for item in reference:
        assert heap.key(item) == reference[item]
