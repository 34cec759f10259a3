"""The parts of a server that load torch: its in-process groups, and the router's view of a
model directory (hasher, tokenizer, context) read the way an engine reads it.

Only a process that runs its own groups imports this module, on the loading thread (build.py:
`_local`), so that its doors answer health while torch loads; a router of a cluster never does.
"""

from __future__ import annotations

from cluster.index import IndexWriter
from cluster.local_group import LocalGroup
from router.launch.build import engine_config
from router.launch.config import ServeConfig
from router.router import ModelInfo
from worker.config import EngineConfig
from worker.engine.llm_engine import block_hasher, load_tokenizer
from worker.hashing import BlockHasher
from worker.model.model_loader import read_model_config
from worker.protocol import ModelFacts


def local_groups(config: ServeConfig, secret: str, index: tuple[IndexWriter, ...]) -> list[LocalGroup]:
    """The in-process groups (TP=1), publishing to `index`; "cuda" gives group i cuda:i."""
    groups = []
    for i in range(config.cluster.groups):
        device = f"cuda:{i}" if config.cluster.device == "cuda" else config.cluster.device
        groups.append(LocalGroup(engine_config(config, secret, device=device), index, group_id=f"group-{i}"))
    return groups


def router_side(probe: EngineConfig, name: str) -> tuple[BlockHasher, object, ModelInfo]:
    """The router's hasher, tokenizer and ModelInfo, read from the model directory without
    loading weights (groups may live in other processes); the hasher is built by the same
    function as every engine's (`worker.engine.llm_engine.block_hasher`)."""
    mc = read_model_config(probe.model)
    hasher = block_hasher(probe, mc)
    max_len = mc.max_position_embeddings
    facts = ModelFacts(
        hasher.fingerprint,
        min(probe.max_model_len or max_len, max_len),
        mc.vocab_size,
        tuple(mc.eos_token_ids),
        tokenizer_files=None,
    )
    return hasher, load_tokenizer(probe.model), ModelInfo.of(name, facts)
