"""The kv_tiers benchmark's library workload, small: with a host tier the revisited documents
are restored (fewer prompt tokens computed, the same greedy outputs as without a tier)."""

from benchmarks.kv_tiers import revisits
from pagefleet.llm import LLM


def test_revisits_restore_documents_from_the_host_and_disk_tiers():
    probe = LLM("builtin", block_size=16, num_blocks=8, max_model_len=64)
    block_bytes = probe.engine.stats()["kv_bytes_per_token"] * 16
    vocab = probe.engine.model_config.vocab_size
    probe.engine.executor.shutdown()
    none, host, host_disk = revisits("builtin", 128, vocab, block_bytes)
    assert [line["tiers"] for line in (none, host, host_disk)] == ["none", "host", "host_disk"]
    assert none["docs_over_pool"] > 3
    # every visit after the first round finds its document evicted from the pool
    assert none["restored_tokens_host"] == 0 and none["prompt_tokens_computed"] > 4 * 8 * 128
    for line in (host, host_disk):
        assert line["same_output_as_none"]
        assert line["restored_tokens_host"] > 0
        assert line["computed_fall"] > 0.7
    assert host_disk["restored_tokens_disk"] > 0
