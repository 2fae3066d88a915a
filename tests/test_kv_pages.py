"""Page bookkeeping: reference counts, forks, the prefix cache's hash chain and LRU eviction."""

import pytest

from tiderl_jax.engine.kv_pages import OutOfPages, PagePool, block_key


def test_allocate_release_and_fork():
    pool = PagePool(4, 8)  # pages 1..3 usable
    a, b = pool.allocate(), pool.allocate()
    assert 0 not in (a, b) and pool.num_used == 2
    pool.fork(a)
    pool.release(a)
    assert pool.num_used == 2  # still referenced by the fork
    pool.release(a)
    pool.release(b)
    assert pool.num_used == 0 and pool.num_free == 3
    for _ in range(3):
        pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()


def test_registered_pages_are_cached_then_evicted_oldest_first():
    pool = PagePool(4, 8)
    keys = [block_key(None, [i] * 8, 0) for i in range(3)]
    pages = [pool.allocate() for _ in range(3)]
    for p, k in zip(pages, keys):
        pool.register(p, k)
    for p in pages:
        pool.release(p)
    assert pool.num_cached == 3 and pool.num_free == 3
    assert pool.lookup(keys[1]) == pages[1]  # a hit revives the page (refcount 1, not evictable)
    assert pool.num_cached == 2
    first = pool.allocate()  # evicts the least recently released cached page: keys[0]
    assert first == pages[0] and pool.lookup(keys[0]) is None and pool.evictions == 1
    assert pool.lookup(keys[2]) == pages[2]


def test_hash_chain_depends_on_parent_tokens_and_version():
    a = block_key(None, [1, 2, 3], 0)
    assert block_key(None, [1, 2, 3], 0) == a
    assert block_key(None, [1, 2, 4], 0) != a
    assert block_key(None, [1, 2, 3], 1) != a
    assert block_key(a, [1, 2, 3], 0) != a


def test_first_registration_wins_and_drop_cached():
    pool = PagePool(5, 4)
    k = block_key(None, [9] * 4, 0)
    p1, p2 = pool.allocate(), pool.allocate()
    pool.register(p1, k)
    pool.register(p2, k)  # same content computed twice: the first page stays the cached one
    pool.release(p1)
    pool.release(p2)
    assert pool.num_cached == 1 and pool.lookup(k) == p1
    pool.release(p1)
    assert pool.drop_cached() == 1 and pool.lookup(k) is None
