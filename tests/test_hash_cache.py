"""The router's hash-chain cache returns exactly `BlockHasher.hash_prompt`'s chain, cached or not."""

from __future__ import annotations

import json
import random
import threading
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


def fresh_token(rng: random.Random, avoid: int) -> int:
    t = rng.randrange(VOCAB)
    return t if t != avoid else (t + 1) % VOCAB


def test_a_prompt_reuses_every_block_it_shares_with_a_stored_one():
    # Divergence at every token of a 5-segment document (block 4, 12 tokens per segment): inside
    # a block, at a block edge, at a segment edge, and no divergence (a prefix of the document).
    rng = random.Random(8)
    doc = random_ids(rng, 60)
    for cut in range(len(doc) + 1):
        for extra in (0, 1, 7, 30):
            cache = make_cache(block_size=4, segment_blocks=3)
            cache.hash_prompt(doc)
            before = cache.stats.hashed_blocks
            suffix = [fresh_token(rng, doc[cut] if cut < len(doc) else -1)] if extra else []
            prompt = doc[:cut] + suffix + random_ids(rng, max(extra - 1, 0))
            assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
            # Only the blocks from the first one holding a new token on are hashed.
            new_blocks = len(prompt) // 4 - min(cut // 4, len(prompt) // 4) if extra else 0
            assert cache.stats.hashed_blocks - before == new_blocks, (cut, extra)


def test_many_questions_on_one_document_are_each_an_exact_hit_when_asked_again():
    rng = random.Random(9)
    cache = make_cache(block_size=4, segment_blocks=3)
    doc = random_ids(rng, 4 * 10)  # ends inside a segment: every question shares its segment
    questions = [random_ids(rng, rng.randrange(1, 20)) for _ in range(40)]
    for q in questions:
        before = cache.stats.hashed_blocks
        chain = cache.hash_prompt(doc + q)
        assert chain == cache.hasher.hash_prompt(doc + q)
        if before:  # the document's 10 blocks are shared with the earlier prompts
            assert cache.stats.hashed_blocks - before == len(chain) - 10
    before = cache.stats.hashed_blocks
    for q in reversed(questions):
        assert cache.hash_prompt(doc + q) == cache.hasher.hash_prompt(doc + q)
    assert cache.stats.hashed_blocks == before


def test_a_growing_chat_hashes_only_its_new_blocks_and_keeps_no_stale_prefixes():
    rng = random.Random(10)
    cache = make_cache(block_size=4, segment_blocks=3)
    prompt: list[int] = []
    for _turn in range(15):
        prompt += random_ids(rng, rng.randrange(1, 15))
        before_hashed, before_cached = cache.stats.hashed_blocks, cache.stats.cached_blocks
        chain = cache.hash_prompt(prompt)
        assert chain == cache.hasher.hash_prompt(prompt)
        assert cache.stats.cached_blocks - before_cached == before_hashed  # all earlier blocks
        assert cache.stats.hashed_blocks == len(chain)
        # One entry per (possibly partial) segment of the chain: a turn's partial last segment
        # is replaced by the next turn's longer one.
        assert len(cache) == -(-len(chain) // 3)


@pytest.mark.parametrize(
    "first, second",
    [
        ({}, {"cache_salt": "tenant-a"}),
        ({}, {"adapter_id": "lora-1"}),
        ({"adapter_id": "lora-1"}, {"adapter_id": "lora-2"}),
        ({"adapter_id": "lora-1"}, {"cache_salt": "lora-1"}),
    ],
)
def test_adapters_and_salts_never_share_entries(first, second):
    rng = random.Random(11)
    cache = make_cache()
    doc = random_ids(rng, 70)
    a = cache.hash_prompt(doc, **first)
    hashed = cache.stats.hashed_blocks
    b = cache.hash_prompt(doc[:50], **second)  # a partial segment, prefix of a stored one
    assert cache.stats.hashed_blocks == hashed + len(b) and set(a).isdisjoint(b)
    assert b == cache.hasher.hash_prompt(doc[:50], **second)


def test_stats_count_every_block_once():
    rng = random.Random(12)
    cache = make_cache()
    docs = [random_ids(rng, 90) for _ in range(3)]
    total = 0
    for _ in range(100):
        prompt = rng.choice(docs)[: rng.randrange(91)] + random_ids(rng, rng.randrange(10))
        total += len(cache.hash_prompt(prompt))
        assert cache.stats.cached_blocks + cache.stats.hashed_blocks == total


def test_threads_sharing_one_small_cache_get_exact_chains():
    rng = random.Random(13)
    probe = make_cache()
    cache = make_cache(max_bytes=12 * probe.entry_bytes)
    docs = [random_ids(rng, 80) for _ in range(4)]
    prompts = [rng.choice(docs)[: rng.randrange(81)] + random_ids(rng, rng.randrange(12)) for _ in range(400)]
    errors: list[int] = []

    def work(part: list[list[int]]) -> None:
        for i, p in enumerate(part):
            if cache.hash_prompt(p) != cache.hasher.hash_prompt(p):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(prompts[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) <= 12 and cache.stats.evictions > 0


def test_a_one_token_edit_anywhere_rehashes_from_its_block_on():
    # The edited prompt equals the stored one before and after the edit, so a compare of a
    # segment's first or last bytes alone would wrongly call it a hit.
    rng = random.Random(14)
    doc = random_ids(rng, 4 * 9 + 2)  # 3 segments of 3 blocks, plus a partial block
    cache = make_cache(block_size=4, segment_blocks=3)
    cache.hash_prompt(doc)
    for i in range(len(doc)):
        edited = doc[:i] + [fresh_token(rng, doc[i])] + doc[i + 1 :]
        before = cache.stats.hashed_blocks
        assert cache.hash_prompt(edited) == cache.hasher.hash_prompt(edited)
        assert cache.stats.hashed_blocks - before == max(9 - i // 4, 0), i


# Runs: several whole segments a walk went through, served later by one memcmp.


def test_many_questions_on_a_long_document_are_served_by_one_run():
    rng = random.Random(15)
    cache = make_cache(block_size=4, segment_blocks=3)
    doc = random_ids(rng, 12 * 10 + 5)  # 10 full segments and a partial one
    for i in range(30):
        prompt = doc + random_ids(rng, rng.randrange(0, 20))
        before_hashed, before_runs = cache.stats.hashed_blocks, cache.stats.run_hits
        chain = cache.hash_prompt(prompt)
        assert chain == cache.hasher.hash_prompt(prompt)
        if i >= 2:  # the second prompt went through the stored segments and left a run
            assert cache.stats.run_hits == before_runs + 1
            assert cache.stats.hashed_blocks - before_hashed == len(chain) - len(doc) // 4
    assert cache.num_bytes > len(cache) * cache.entry_bytes  # the run is counted


def test_a_prompt_diverging_inside_a_run_falls_back_to_its_segments():
    rng = random.Random(16)
    cache = make_cache(block_size=4, segment_blocks=3)
    doc = random_ids(rng, 12 * 6)
    for _ in range(2):
        cache.hash_prompt(doc + random_ids(rng, 9))  # the second leaves a run of the document
    for cut in range(len(doc) + 1):
        tail = [fresh_token(rng, doc[cut])] if cut < len(doc) else []
        prompt = doc[:cut] + tail + random_ids(rng, 6)
        before = cache.stats.hashed_blocks
        assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
        # Every block before the one holding the new token is reused.
        assert cache.stats.hashed_blocks - before == len(prompt) // 4 - cut // 4, cut
    before = cache.stats.run_hits
    prompt = doc + random_ids(rng, 5)
    assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
    assert cache.stats.run_hits == before + 1  # the run survived the cuts of its segments


def test_a_run_serves_its_evicted_segments_and_goes_with_its_first():
    rng = random.Random(17)
    budget = 12 * make_cache().entry_bytes
    doc = random_ids(rng, 12 * 5)  # 5 segments
    others = [random_ids(rng, 12) for _ in range(30)]
    outcomes = []
    for pushed in range(len(others)):
        cache = make_cache(max_bytes=budget)
        for _ in range(2):
            cache.hash_prompt(doc)  # the second leaves a run of the 5 segments
        assert cache.num_bytes > len(cache) * cache.entry_bytes
        for prompt in others[:pushed]:  # one-segment prompts push the document out, end first
            assert cache.hash_prompt(prompt) == cache.hasher.hash_prompt(prompt)
            assert cache.num_bytes <= budget
        evicted, hashed = cache.stats.evictions, cache.stats.hashed_blocks
        assert cache.hash_prompt(doc) == cache.hasher.hash_prompt(doc)
        assert cache.num_bytes <= budget
        if cache.stats.hashed_blocks == hashed:
            assert cache.stats.run_hits == 1  # served by the run, evicted segments included
            outcomes.append("run" if evicted else "kept")
        else:  # the first segment went last, with the run: everything is hashed again
            assert cache.stats.hashed_blocks - hashed == 15
            outcomes.append("hashed")
    # Early the document is whole; then its end is evicted but the run serves it; then it goes.
    assert outcomes == sorted(outcomes, key=["kept", "run", "hashed"].index)
    assert {"kept", "run", "hashed"} <= set(outcomes)


def test_random_histories_with_runs_under_a_small_budget_match_hash_prompt():
    rng = random.Random(18)
    probe = make_cache()
    for budget in (3, 8, 20, 60):
        cache = make_cache(max_bytes=budget * probe.entry_bytes)
        docs = [random_ids(rng, rng.randrange(30, 150)) for _ in range(5)]
        for _ in range(250):
            doc = rng.choice(docs)
            prompt = doc[: rng.randrange(len(doc) + 1)] + random_ids(rng, rng.randrange(0, 20))
            if rng.random() < 0.1:  # an edit inside the shared part
                i = rng.randrange(len(prompt) or 1)
                prompt[i:i] = [rng.randrange(VOCAB)]
            salt = rng.choice([None, "tenant-a"])
            want = cache.hasher.hash_prompt(prompt, cache_salt=salt)
            assert cache.hash_prompt(prompt, cache_salt=salt) == want
            assert cache.num_bytes <= cache.config.max_bytes
        assert cache.stats.evictions > 0
        if budget >= 20:
            assert cache.stats.run_hits > 0


def test_tenants_get_their_own_runs():
    rng = random.Random(19)
    cache = make_cache()
    doc = random_ids(rng, 12 * 8)
    chains = {}
    for _ in range(3):
        for salt in ("tenant-a", "tenant-b"):
            before = cache.stats.hashed_blocks
            chains[salt] = cache.hash_prompt(doc, cache_salt=salt)
            assert chains[salt] == cache.hasher.hash_prompt(doc, cache_salt=salt)
    assert cache.stats.hashed_blocks == before  # the third round was all served
    assert cache.stats.run_hits == 2  # one run each, in the third round
    assert set(chains["tenant-a"]).isdisjoint(chains["tenant-b"])


def test_clear_drops_segments_and_runs():
    rng = random.Random(20)
    cache = make_cache()
    doc = random_ids(rng, 12 * 6)
    for _ in range(3):
        cache.hash_prompt(doc)
    assert cache.stats.run_hits == 1
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0
    before = cache.stats.hashed_blocks
    assert cache.hash_prompt(doc) == cache.hasher.hash_prompt(doc)
    assert cache.stats.hashed_blocks - before == len(doc) // 4 and cache.stats.run_hits == 1
