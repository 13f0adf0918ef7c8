"""Block accounting and the prefix cache: every scenario ends with the invariants checked."""

import numpy as np
import pytest

from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks, block_hashes

BS = 4


@pytest.fixture
def mgr():
    m = BlockManager(8, BS)
    yield m
    m.check()


def test_allocate_release_round_trip(mgr):
    a = mgr.allocate(3)
    b = mgr.allocate(5)
    assert sorted(a + b) == list(range(8)) and mgr.num_available == 0
    with pytest.raises(OutOfBlocks, match="need 1 blocks, 0 of 8 available"):
        mgr.allocate(1)
    mgr.release(a)
    mgr.release(b)
    assert mgr.num_available == 8 and mgr.num_used == 0


def test_failed_allocation_takes_nothing(mgr):
    mgr.allocate(6)
    with pytest.raises(OutOfBlocks):
        mgr.allocate(3)
    assert mgr.num_available == 2


def test_double_release_is_an_error(mgr):
    a = mgr.allocate(1)
    mgr.release(a)
    with pytest.raises(ValueError, match="released more often"):
        mgr.release(a)


def test_hash_chain_names_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a


def test_shared_prefix_is_reused_and_counted(mgr):
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    blocks = mgr.match_prefix(prompt) + mgr.allocate(3)
    assert mgr.stats["hit_tokens"] == 0
    mgr.register(prompt, blocks)
    other = list(range(9)) + [99, 100]  # shares the first 2 full blocks
    hit = mgr.match_prefix(other)
    assert hit == blocks[:2] and mgr.stats["hit_tokens"] == 2 * BS
    assert mgr.refcount(blocks[0]) == 2
    rest = mgr.allocate(1)
    mgr.release(blocks)
    mgr.release(hit + rest)
    # Registered blocks outlive their requests as cached (still available) blocks.
    assert mgr.num_available == 8
    assert mgr.match_prefix(prompt) == blocks[:2]
    mgr.release(blocks[:2])


def test_last_token_is_never_matched(mgr):
    prompt = list(range(8))  # exactly 2 full blocks
    blocks = mgr.allocate(2)
    mgr.register(prompt, blocks)
    mgr.release(blocks)
    assert mgr.match_prefix(prompt) == blocks[:1]  # the request must prefill >= 1 token
    mgr.release(blocks[:1])


def test_lru_eviction_under_pressure(mgr):
    old, new = list(range(100, 108)), list(range(200, 208))
    a = mgr.allocate(2)
    mgr.register(old, a)
    mgr.release(a)
    b = mgr.allocate(2)
    mgr.register(new, b)
    mgr.release(b)
    assert mgr.num_available == 8
    taken = mgr.allocate(6)  # 4 free, then the 2 least recently used cached blocks
    assert set(a) <= set(taken) and mgr.stats["evictions"] == 2
    assert mgr.match_prefix(old + [1]) == []  # evicted: no longer a hit
    assert mgr.match_prefix(new + [1]) == b
    mgr.release(taken + b)


def test_spilled_blocks_come_back_from_host():
    device = {}  # block -> contents: a stand-in for the pool's pages
    m = BlockManager(4, BS, spill=lambda b: device[b],
                     restore=lambda data, b: device.__setitem__(b, data),
                     host_capacity=4)
    prompt = list(range(9))
    blocks = m.allocate(2)
    for i, blk in enumerate(blocks):
        device[blk] = f"kv{i}"
    m.register(prompt, blocks)
    m.release(blocks)
    hog = m.allocate(4)  # evicts both cached blocks: they spill
    assert m.stats["spills"] == 2
    for blk in hog:
        device[blk] = "overwritten"
    m.release(hog)
    hit = m.match_prefix(prompt)
    assert len(hit) == 2 and m.stats["restores"] == 2
    assert [device[b] for b in hit] == ["kv0", "kv1"]
    m.release(hit)
    m.check()


def test_prefix_cache_off_never_matches():
    m = BlockManager(4, BS, prefix_cache=False)
    blocks = m.allocate(2)
    m.register(list(range(9)), blocks)
    m.release(blocks)
    assert m.match_prefix(list(range(9))) == [] and m.num_available == 4
    m.check()


def test_random_workload_keeps_invariants():
    rng = np.random.default_rng(0)
    m = BlockManager(32, BS)
    live = []
    prefixes = [list(rng.integers(0, 50, 12)) for _ in range(4)]
    for _ in range(400):
        if live and rng.random() < 0.45:
            m.release(live.pop(rng.integers(len(live))))
        else:
            prompt = prefixes[rng.integers(4)] + list(rng.integers(0, 50, rng.integers(1, 9)))
            hit = m.match_prefix(prompt)
            need = -(-len(prompt) // BS) - len(hit)
            try:
                blocks = hit + m.allocate(need)
            except OutOfBlocks:
                m.release(hit)
                continue
            m.register(prompt, blocks)
            live.append(blocks)
        m.check()
    for blocks in live:
        m.release(blocks)
    m.check()
    assert m.num_available == 32 and m.stats["hit_tokens"] > 0
