"""Allocator: page hand-out, ref-counts, the free bitmask and misuse detection."""

from __future__ import annotations

import numpy as np
import pytest

from astrai.kvcache import Allocator


def test_alloc_hands_out_distinct_pages_and_clears_their_free_bits():
    alloc = Allocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(2)
    assert len(set(a + b)) == 5
    assert alloc.num_free == 3
    expected_free = np.ones(8, dtype=bool)
    expected_free[a + b] = False
    np.testing.assert_array_equal(alloc.free_mask, expected_free)
    assert alloc.refcount[a + b].tolist() == [1] * 5
    assert sorted(alloc.free_pages()) == np.flatnonzero(expected_free).tolist()


def test_alloc_when_short_returns_none_and_changes_nothing():
    alloc = Allocator(4)
    alloc.alloc(3)
    refcount, mask = alloc.refcount.copy(), alloc.free_mask.copy()
    assert alloc.alloc(2) is None
    np.testing.assert_array_equal(alloc.refcount, refcount)
    np.testing.assert_array_equal(alloc.free_mask, mask)
    assert alloc.num_free == 1
    assert alloc.alloc(0) == []


def test_page_is_freed_only_when_its_last_holder_lets_go():
    alloc = Allocator(4)
    (page,) = alloc.alloc(1)
    alloc.incref([page])
    alloc.incref([page])
    assert alloc.refcount[page] == 3
    assert alloc.decref([page]) == []
    assert alloc.decref([page]) == []
    assert not alloc.free_mask[page]
    assert alloc.decref([page]) == [page]
    assert alloc.free_mask[page] and alloc.refcount[page] == 0
    assert alloc.num_free == 4


def test_decref_of_a_page_listed_twice_drops_two_holders():
    alloc = Allocator(2)
    (page,) = alloc.alloc(1)
    alloc.incref([page, page])
    assert alloc.refcount[page] == 3
    assert alloc.decref([page, page]) == []
    assert alloc.refcount[page] == 1


def test_double_free_raises_and_leaves_the_pool_intact():
    alloc = Allocator(4)
    a, b = alloc.alloc(2)
    alloc.decref([a])
    refcount, mask, free = alloc.refcount.copy(), alloc.free_mask.copy(), alloc.free_pages()
    with pytest.raises(RuntimeError, match="double free"):
        alloc.decref([b, a])
    np.testing.assert_array_equal(alloc.refcount, refcount)
    np.testing.assert_array_equal(alloc.free_mask, mask)
    assert alloc.free_pages() == free


def test_incref_of_a_free_page_raises():
    alloc = Allocator(4)
    with pytest.raises(RuntimeError, match="free page"):
        alloc.incref([2])
    assert alloc.refcount.sum() == 0


def test_freed_pages_are_handed_out_again():
    alloc = Allocator(3)
    pages = alloc.alloc(3)
    assert alloc.alloc(1) is None
    alloc.decref([pages[1]])
    assert alloc.alloc(1) == [pages[1]]


def test_rejects_an_empty_pool_and_negative_requests():
    with pytest.raises(ValueError):
        Allocator(0)
    with pytest.raises(ValueError):
        Allocator(2).alloc(-1)
