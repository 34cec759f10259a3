import hashlib
import pickle
import subprocess
import sys
from array import array

import pytest

from cluster.index.probes import probe_hashes
from worker.hashing import BlockHasher, HashChain, ModelFingerprint

SECRET = b"s3cret"


def hasher(**fp) -> BlockHasher:
    return BlockHasher(SECRET, ModelFingerprint(**{"model_id": "m", "block_size": 4, **fp}))


def test_chain_is_keyed_blake2b_over_parent_and_tokens():
    h = hasher()
    tokens = list(range(10))
    root = h.root()
    chain = h.hash_blocks(tokens, root)
    assert len(chain) == 2  # only full blocks
    want0 = hashlib.blake2b(root + array("I", tokens[:4]).tobytes(), key=SECRET, digest_size=16)
    want1 = hashlib.blake2b(want0.digest() + array("I", tokens[4:8]).tobytes(), key=SECRET, digest_size=16)
    assert chain == [want0.digest(), want1.digest()]
    assert all(len(x) == 16 for x in chain)


def test_each_block_covers_every_earlier_token():
    h = hasher()
    a = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], h.root())
    b = h.hash_blocks([1, 2, 3, 9, 5, 6, 7, 8], h.root())
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history


def test_resuming_a_chain_matches_hashing_at_once():
    h = hasher()
    tokens = list(range(40))
    whole = h.hash_blocks(tokens, h.root())
    assert h.hash_blocks(tokens, whole[3], start_block=4) == whole[4:]


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"revision": "r2"},
        {"dtype": "bfloat16"},
        {"kv_cache_dtype": "int8"},
    ],
)
def test_fingerprint_changes_every_hash(change):
    tokens = list(range(8))
    base = hasher().hash_prompt(tokens)
    other = hasher(**change).hash_prompt(tokens)
    assert set(base).isdisjoint(other)


def test_adapter_salt_and_secret_change_every_hash():
    tokens = list(range(12))
    h = hasher()
    base = h.hash_prompt(tokens)
    variants = [
        h.hash_prompt(tokens, adapter_id="lora-a"),
        h.hash_prompt(tokens, cache_salt="tenant-a"),
        h.hash_prompt(tokens, cache_salt="tenant-b"),
        BlockHasher(b"another", ModelFingerprint("m", block_size=4)).hash_prompt(tokens),
    ]
    seen = set(base)
    for v in variants:
        assert seen.isdisjoint(v)
        seen |= set(v)


def test_field_boundaries_are_unambiguous():
    h = hasher()
    assert h.root("ab", "c") != h.root("a", "bc")


def test_same_hashes_in_another_process():
    tokens = list(range(33))
    code = (
        "from worker.hashing import BlockHasher, ModelFingerprint;"
        "h=BlockHasher(b's3cret', ModelFingerprint(model_id='m', block_size=4));"
        f"print(','.join(x.hex() for x in h.hash_prompt({tokens}, cache_salt='t')))"
    )
    env = {"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=".")
    assert out.stdout.strip().split(",") == [x.hex() for x in hasher().hash_prompt(tokens, cache_salt="t")]


def test_bad_input():
    with pytest.raises(ValueError, match="secret"):
        BlockHasher(b"", ModelFingerprint("m"))
    with pytest.raises(ValueError, match="token ids"):
        hasher().hash_prompt([-1, 2, 3, 4])


def test_hash_chain_reads_like_the_list_of_its_hashes():
    hashes = hasher().hash_prompt(list(range(4 * 70)))
    chain = HashChain(b"".join(hashes))
    assert len(chain) == 70 and chain == hashes and chain == tuple(hashes)
    assert [chain[i] for i in (0, 5, 69, -1, -70)] == [hashes[i] for i in (0, 5, 69, -1, -70)]
    for s in (slice(3, 40), slice(None), slice(60, 200), slice(50, 10), slice(1, 60, 7)):
        assert chain[s] == hashes[s]
    assert list(chain) == hashes and chain.at((2, 64, 69)) == (hashes[2], hashes[64], hashes[69])
    assert chain.at((7,)) == (hashes[7],) and chain.at(()) == ()
    assert chain.index(hashes[33]) == 33 and hashes[33] in chain
    assert pickle.loads(pickle.dumps(chain)) == chain
    assert chain != hashes[:-1] and chain != HashChain(b"".join(hashes[:-1]))
    assert probe_hashes(chain) == probe_hashes(hashes)
    with pytest.raises(IndexError):
        chain[70]
    with pytest.raises(ValueError, match="multiple of 16"):
        HashChain(b"x" * 17)
