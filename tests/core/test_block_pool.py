from tokenmill.core.block_hash import BlockHasher
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(rid, tokens, bs=4, caching=True, **sp):
    hasher = BlockHasher(bs, "sha256") if caching else None
    return Request(rid, list(tokens), SamplingParams(**sp), 0.0, max_model_len=1024, block_hasher=hasher)


def test_pool_lru_and_eviction_drops_cache():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], b"h0")
    assert pool.get_cached_block(b"h0") is a[0]
    pool.free_blocks(reversed(a))
    assert pool.get_num_free_blocks() == 4
    # Free order: the two never-used blocks first, then a[1], then a[0] (freed tail-first).
    got = pool.allocate(3)
    assert [b.block_id for b in got][-1] == a[1].block_id
    assert pool.get_cached_block(b"h0") is a[0]  # still cached, not yet evicted
    pool.allocate(1)
    assert pool.get_cached_block(b"h0") is None


def test_touch_revives_free_cached_block():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_full_block(b, b"x")
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 2
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 1


def test_block_hashes_chain_and_differ():
    r1 = make_request("a", range(10))
    r2 = make_request("b", list(range(8)) + [99, 98])
    assert len(r1.block_hashes) == 2
    assert r1.block_hashes == r2.block_hashes[:2]
    r3 = make_request("c", [1] + list(range(1, 10)))
    assert r3.block_hashes[0] != r1.block_hashes[0] and r3.block_hashes[1] != r1.block_hashes[1]
    r1.append_output_token_ids([5, 5])
    assert len(r1.block_hashes) == 3


def test_xxhash_algo():
    h = BlockHasher(4, "xxhash")
    r = Request("x", list(range(8)), SamplingParams(), 0.0, block_hasher=h)
    assert len(r.block_hashes) == 2 and len(r.block_hashes[0]) == 16


def test_manager_prefix_hit_keeps_one_token_and_refcounts():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    r1 = make_request("r1", range(12))
    hits, n = kv.get_computed_blocks(r1)
    assert (hits, n) == ([], 0)
    ids1 = kv.allocate_slots(r1, 12)
    assert len(ids1) == 3
    r2 = make_request("r2", list(range(12)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8  # 12 tokens: the last full block is not reused so one token is left to compute
    ids2 = kv.allocate_slots(r2, 12 - n, hits)
    assert ids2[:2] == ids1[:2] and ids2[2] != ids1[2]
    assert kv.pool.blocks[ids1[0]].ref_cnt == 2
    kv.free(r1)
    kv.free(r2)
    assert kv.num_free_blocks() == 10
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.prefix_hits == 8 and kv.prefix_queries == 24


def test_manager_refuses_when_full_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    r = make_request("r", range(8), caching=False)
    assert kv.allocate_slots(r, 8) is not None
    r2 = make_request("r2", range(8), caching=False)
    before = kv.num_free_blocks()
    assert kv.allocate_slots(r2, 8) is None
    assert kv.num_free_blocks() == before and "r2" not in kv.req_to_blocks


def test_prompt_logprobs_bypass_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    r1 = make_request("r1", range(12))
    kv.allocate_slots(r1, 12)
    r2 = make_request("r2", range(12), prompt_logprobs=1)
    assert kv.get_computed_blocks(r2) == ([], 0)
