"""Small factories for tests that drive the real block manager and scheduler."""

from __future__ import annotations

import itertools
import random
import time

from worker.config import SchedulerConfig
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.hashing import BlockHasher, ModelFingerprint
from worker.kv_events import KVEvent
from worker.sampling_params import SamplingParams

SECRET = b"test-cluster-secret"
_ids = itertools.count()


def make_hasher(block_size: int = 4, model_id: str = "test-model") -> BlockHasher:
    return BlockHasher(SECRET, ModelFingerprint(model_id, block_size=block_size))


def make_block_manager(
    num_blocks: int = 16, block_size: int = 4, prefix_caching: bool = True
) -> tuple[BlockManager, list[KVEvent]]:
    events: list[KVEvent] = []
    hasher = make_hasher(block_size) if prefix_caching else None
    return BlockManager(num_blocks, block_size, hasher, events.append), events


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True, **config
) -> tuple[Scheduler, list[KVEvent]]:
    bm, events = make_block_manager(num_blocks, block_size, prefix_caching)
    config.setdefault("max_model_len", 1024)
    return Scheduler(SchedulerConfig(**config), bm), events


def make_request(
    prompt: list[int] | int = 8,
    max_tokens: int = 4,
    *,
    request_id: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    hasher: BlockHasher | None = None,
    eos: tuple[int, ...] = (),
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = [random.randrange(1000) for _ in range(prompt)]
    hasher = hasher or make_hasher()
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        max_tokens=max_tokens,
        eos_token_ids=eos,
        priority=priority,
        arrival_time=arrival_time if arrival_time is not None else float(next(_ids)),
        hash_root=hasher.root(cache_salt=cache_salt),
    )


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **kw) -> list[Request]:
    return [make_request(prompt_len, max_tokens, **kw) for _ in range(n)]


def run_to_completion(scheduler: Scheduler, next_token=lambda req: 7, max_steps: int = 10_000, on_step=None) -> list:
    """Drive the scheduler with a fake runner that samples `next_token(req)`; returns outputs.
    `on_step(out)` sees each step after scheduling, before the tokens come back."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        out = scheduler.schedule()
        outputs.append(out)
        if on_step is not None:
            on_step(out)
        sampled = {s.request.request_id: next_token(s.request) for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, sampled)
    raise AssertionError("scheduler did not finish")


def check_invariants(bm: BlockManager) -> None:
    """Accounting that must hold after every operation."""
    in_use = {b.block_id for blocks in bm.req_blocks.values() for b in blocks}
    free = [b.block_id for b in bm.free_queue]
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    assert all(b.ref_cnt >= 0 for b in bm.blocks), "negative ref count"
    assert not (set(free) & in_use), "a block is both free and referenced"
    assert len(free) + len(in_use) == bm.num_blocks, "free + in use != pool"
    for b in bm.blocks:
        holders = sum(blocks.count(b) for blocks in bm.req_blocks.values())
        assert b.ref_cnt == holders, f"{b} ref count != holders {holders}"
    for h, b in bm.cached.items():
        assert b.block_hash == h, "a cached hash maps to a block not holding it"
    assert sum(1 for b in bm.blocks if b.block_hash is not None) == len(bm.cached)


def check_all_released(bm: BlockManager) -> None:
    check_invariants(bm)
    assert not bm.req_blocks
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"


def wait_until(predicate, timeout_s: float, step_s: float = 0.02) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def transformers_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    import torch

    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def fail_after(group, steps: int) -> None:
    """An in-process group's device fails after `steps` more steps: its engine dies of a
    RuntimeError, as a lost device would kill it, and its streams with it."""
    engine = group.engine.engine
    done, execute = [0], engine.executor.execute

    def fails(out):
        done[0] += 1
        if done[0] > steps:
            raise RuntimeError("device lost")
        return execute(out)

    engine.executor.execute = fails
