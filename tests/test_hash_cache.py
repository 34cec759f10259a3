"""The router's hash-chain cache returns exactly `BlockHasher.hash_prompt`'s chain, cached or not."""

from __future__ import annotations

import json
import random
import time

import pytest

from router.hash_cache import HashCacheConfig, PrefixHashCache
from tests.factories import make_hasher

VOCAB = 50_000


def make_cache(block_size: int = 4, **overrides) -> PrefixHashCache:
    config = {"segment_blocks": 3, **overrides}
    return PrefixHashCache(make_hasher(block_size), HashCacheConfig(**config))


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_random_prompts_with_shared_prefixes_match_hash_prompt():
    rng = random.Random(0)
    cache = make_cache()
    docs = [random_ids(rng, rng.randrange(0, 200)) for _ in range(4)]
    for _ in range(300):
        doc = rng.choice(docs)
        # Cut the document anywhere (partial blocks and partial segments included) and add a
        # question, sometimes none.
        prompt = doc[: rng.randrange(len(doc) + 1)] + random_ids(rng, rng.randrange(0, 30))
        salt = rng.choice([None, "tenant-a", "tenant-b"])
        adapter = rng.choice([None, "lora-1"])
        want = cache.hasher.hash_prompt(prompt, adapter_id=adapter, cache_salt=salt)
        assert cache.hash_prompt(prompt, adapter_id=adapter, cache_salt=salt) == want
    assert cache.stats.cached_blocks > 0 and len(cache) > 0


def test_a_repeated_document_is_served_from_the_table():
    rng = random.Random(1)
    cache = make_cache(block_size=4, segment_blocks=3)  # 12 tokens per segment
    doc = random_ids(rng, 120)  # 10 segments
    cache.hash_prompt(doc + random_ids(rng, 5))
    before = cache.stats.hashed_blocks
    prompt = doc + random_ids(rng, 9)
    assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
    # Only the question's blocks are hashed again: (120 + 9) // 4 - 30 full blocks.
    assert cache.stats.hashed_blocks - before == len(prompt) // 4 - 30


def test_equal_segments_at_different_positions_get_their_own_chains():
    # A segment's hashes depend on everything before it: the same 12 tokens at the start, after
    # another segment, or repeated, must each hash under their own parent.
    rng = random.Random(7)
    cache = make_cache(block_size=4, segment_blocks=3)
    a, b = random_ids(rng, 12), random_ids(rng, 12)
    for prompt in (a + b, b + a, a + a + a, b, a + a, b + b + a + 3 * [7]):
        assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
    assert cache.stats.cached_blocks > 0


def test_tenants_never_share_entries():
    rng = random.Random(2)
    cache = make_cache()
    doc = random_ids(rng, 60)
    a = cache.hash_prompt(doc, cache_salt="tenant-a")
    hashed = cache.stats.hashed_blocks
    b = cache.hash_prompt(doc, cache_salt="tenant-b")
    assert cache.stats.hashed_blocks == hashed + len(b)  # nothing of tenant a's was reused
    assert set(a).isdisjoint(b)
    assert b == cache.hasher.hash_prompt(doc, cache_salt="tenant-b")


def test_eviction_keeps_the_table_bounded_and_correct():
    rng = random.Random(3)
    probe = make_cache()
    cache = make_cache(max_bytes=5 * probe.entry_bytes)
    assert cache.max_entries == 5
    docs = [random_ids(rng, 100) for _ in range(6)]
    for _ in range(200):
        prompt = rng.choice(docs)[: rng.randrange(101)] + random_ids(rng, rng.randrange(8))
        assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
        assert len(cache) <= 5 and cache.num_bytes <= cache.config.max_bytes
    assert cache.stats.evictions > 0 and cache.stats.cached_blocks > 0


def test_lru_evicts_a_chain_from_its_end():
    rng = random.Random(4)
    probe = make_cache()
    cache = make_cache(max_bytes=4 * probe.entry_bytes)
    doc = random_ids(rng, 12 * 4)  # exactly 4 segments
    cache.hash_prompt(doc)
    cache.hash_prompt(random_ids(rng, 12))  # one new entry pushes one of doc's out
    before = cache.stats.hashed_blocks
    assert cache.hash_prompt(doc) == cache.hasher.hash_prompt(doc)
    # The first three segments still hit; only the evicted last one is hashed again.
    assert cache.stats.hashed_blocks - before == 3


def test_zero_budget_caches_nothing():
    rng = random.Random(5)
    cache = make_cache(max_bytes=0)
    prompt = random_ids(rng, 50)
    for _ in range(2):
        assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
    assert len(cache) == 0 and cache.stats.cached_blocks == 0


def test_bad_token_ids_and_config_are_rejected():
    cache = make_cache()
    with pytest.raises(ValueError, match="token ids"):
        cache.hash_prompt([1, 2, -1, 4])
    with pytest.raises(ValueError, match="max_bytes"):
        HashCacheConfig(max_bytes=-1)
    with pytest.raises(ValueError, match="segment_blocks"):
        HashCacheConfig(segment_blocks=0)


def test_benchmark_32k_prompt_with_cached_document(capsys):
    """Prints one JSON line: time per hash of a 32k-token prompt, document cached or not."""
    rng = random.Random(6)
    cache = PrefixHashCache(make_hasher(block_size=16))
    doc = random_ids(rng, 31_500)
    prompts = [doc + random_ids(rng, 32_768 - len(doc)) for _ in range(20)]
    cache.hash_prompt(doc)  # the document's full segments enter the table

    def per_call_ms(fn) -> float:
        t0 = time.perf_counter()
        for p in prompts:
            fn(p)
        return (time.perf_counter() - t0) / len(prompts) * 1e3

    uncached = per_call_ms(cache.hasher.hash_prompt)
    cached = per_call_ms(cache.hash_prompt)
    for p in prompts[:3]:
        assert cache.hash_prompt(p) == cache.hasher.hash_prompt(p)
    line = {
        "case": "hash_prompt_32k_shared_doc",
        "tokens": 32_768,
        "cached_tokens": 31_500,
        "uncached_ms": round(uncached, 3),
        "cached_ms": round(cached, 3),
        "speedup": round(uncached / cached, 1),
    }
    with capsys.disabled():
        print("\n" + json.dumps(line))
