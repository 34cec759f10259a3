"""Documents as objects: a tenant's prefix that the cluster prefills once and keeps pinned.

A document (text, token ids, or chat messages rendered as the start of a conversation) is
registered for its owner (the salt its blocks are keyed by: an API key's tenant, or the
namespace a keyless caller names), with a time to live and optionally the groups to hold it.
`put` prefills it on each target group (or on the group the placement policy picks) with a
one-token request that carries a `Pin` (worker/protocol.py): once prefilled, the group keeps
the prompt's full blocks pinned (never evicted) until the deadline, which the group enforces
itself, or until `delete` unpins them. Its blocks are ordinary cached blocks otherwise: their
KV events reach the prefix index, so the router places a request that starts with the document
on a group that holds it, and the request's usage counts them as cached tokens.

Where a document is comes from the groups themselves: each group's status lists the documents
it holds pinned (`GroupStatus.pinned`), and the prefix index how many of its blocks each group
caches. A document no live group holds any more (its group died, or was replaced under the same
id by a fresh process) is pinned again, by prefilling it again (`reconcile`, every
RECONCILE_S): a reachable copy in a tier under the new group's pool is found by that prefill as
any prompt's blocks are.

The registry lives in this router's process, or, when the cluster has a Redis (`share`), in
Redis, so that every router replica over the same groups knows every document: one put through
replica 1 is visible, hit and deletable through replica 2, expires at the same moment on both,
and counts once against its tenant's `max_documents` cluster-wide (`SharedRegistry`: one
script per put, so two replicas never both take a tenant's last slot). Each replica keeps the
documents it has seen in `docs`, a cache of Redis's; a document deleted through another replica
is forgotten here (unpinned, and not pinned again) once Redis no longer has it. Replicas with
groups of their own (each `pagefleet serve` its own) each pin a document they learn of on their
own groups, as the reconciler pins any document no live group holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.group import GroupStatus
from cluster.index import PrefixIndexError
from worker.chat import check_messages
from worker.protocol import GenerationRequest, Pin
from worker.sampling_params import SamplingParams
from worker.token_ids import CheckedIds, check_token_ids

if TYPE_CHECKING:
    from router.router import Router

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600
MAX_TTL_S = 7 * 24 * 3600  # a week: a pin longer than that is a deployment's job, not a cache's
DEFAULT_MAX_DOCUMENTS = 16  # live documents per tenant, unless its `max_documents` says
TIERS = ("device", "host")  # where a pin holds a document (Pin.tier; "host" needs a host tier)
RECONCILE_S = 1.0  # how often documents that no live group holds are pinned again
REPIN_GRACE_S = 3.0  # a group's status may lag its pin by a batch: wait this long before re-pinning
REPORT_WAIT_S = 5.0  # a put waits this long for its groups' statuses to list the pin
EXPIRED_KEPT_S = 600.0  # an expired document answers "expired" this long, then is forgotten

PREFILLING, READY, EXPIRED = "prefilling", "ready", "expired"


class DocumentFieldError(ValueError):
    """A field of a document that cannot be pinned as asked (`field`: its name)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class DocumentNotFoundError(LookupError):
    """No document of this id for this caller (another owner's answers the same: ids do not
    leak)."""


class DocumentLimitError(RuntimeError):
    """The owner holds as many live documents as its tenant may (`max_documents`)."""


@dataclass(frozen=True)
class Location:
    """Where a document's blocks are: on one group, in one tier."""

    group_id: str
    tier: str
    blocks_pinned: int  # blocks the group holds pinned for the document
    blocks_cached: int  # the document's blocks the prefix index says the tier holds, after those above it


@dataclass
class Document:
    """One registered document and what the router knows of its pins."""

    document_id: str
    owner: str | None  # the salt its blocks are keyed by (None: the shared namespace)
    tenant: str  # whose limits and fair share it counts against
    ids: CheckedIds
    hashes: Sequence[bytes]  # the chain of its full blocks, as requests that start with it hash
    ttl_s: int
    expires_at: float  # time.time()
    groups: tuple[str, ...] = ()  # the groups the caller named (empty: the router places it)
    tier: str = "device"
    replicas: int = 1  # without named groups: the groups the router keeps it pinned on
    created_at: float = field(default_factory=time.time)
    prefills: int = 0  # prefills in flight
    settled_at: float = 0.0  # time.monotonic() when the last prefill ended

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


_PUT_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[2]) then return held end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
redis.call('SET', KEYS[2], ARGV[5], 'EXAT', math.ceil(tonumber(ARGV[3]) + tonumber(ARGV[6])))
return -1
"""


class SharedRegistry:
    """The documents of every router replica of a cluster, in Redis: `pf:CLUSTER:doc:ID` holds a
    document (JSON, kept EXPIRED_KEPT_S past its deadline), `pf:CLUSTER:docs:OWNER` the owner's
    live ids scored by deadline (what `max_documents` counts)."""

    def __init__(self, client, cluster: str) -> None:
        """`client`: a `redis.Redis`; `cluster`: the namespace (ServeConfig's cluster name)."""
        self.client = client
        self.prefix = f"pf:{cluster}:"
        self._put = client.register_script(_PUT_SCRIPT)

    def _owner_key(self, owner: str | None) -> str:
        return f"{self.prefix}docs:{'' if owner is None else owner}"

    def _doc_key(self, document_id: str) -> str:
        return f"{self.prefix}doc:{document_id}"

    def put(self, doc: Document, limit: int) -> int | None:
        """Register `doc` unless its owner holds `limit` live documents; None when registered,
        else how many it holds."""
        record = {
            "owner": doc.owner,
            "tenant": doc.tenant,
            "ids": list(doc.ids),
            "vocab": doc.ids.vocab,
            "ttl_s": doc.ttl_s,
            "expires_at": doc.expires_at,
            "groups": list(doc.groups),
            "tier": doc.tier,
            "replicas": doc.replicas,
            "created_at": doc.created_at,
        }
        keys = [self._owner_key(doc.owner), self._doc_key(doc.document_id)]
        args = [time.time(), limit, doc.expires_at, doc.document_id, json.dumps(record), EXPIRED_KEPT_S]
        held = int(self._put(keys=keys, args=args))
        return None if held < 0 else held

    def load(self, document_id: str) -> dict | None:
        raw = self.client.get(self._doc_key(document_id))
        return None if raw is None else json.loads(raw)

    def exists(self, document_ids: Sequence[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for document_id in document_ids:
            pipe.exists(self._doc_key(document_id))
        return [bool(n) for n in pipe.execute()]

    def delete(self, doc: Document) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._doc_key(doc.document_id))
        pipe.zrem(self._owner_key(doc.owner), doc.document_id)
        pipe.execute()

    def held(self, owner: str | None) -> int:
        """The owner's live documents, cluster-wide."""
        return int(self.client.zcount(self._owner_key(owner), f"({time.time()}", "+inf"))


class Documents:
    """The documents registered through this router; see the module docstring."""

    def __init__(self, router: Router, max_documents: Mapping[str, int] | None = None) -> None:
        """`max_documents`: each tenant's limit (DEFAULT_MAX_DOCUMENTS for a tenant not in it)."""
        self.router = router
        self.max_documents: Mapping[str, int] = max_documents or {}
        self.docs: dict[str, Document] = {}
        self.shared: SharedRegistry | None = None  # every replica's documents, in Redis
        self._reconciler: asyncio.Task | None = None

    def share(self, client, cluster: str) -> None:
        """Keep the registry in Redis (`client`, a `redis.Redis`), shared by every router
        replica of `cluster` over the same groups."""
        self.shared = SharedRegistry(client, cluster)

    # ---- put ---------------------------------------------------------------------------
    def document_ids(self, text: str | None, messages: Sequence[dict] | None) -> CheckedIds:
        """A document's ids: its text tokenized, or its chat messages rendered as the start of
        a conversation (no assistant turn opened: a request goes on with more messages). Slow
        for a long text: call it on a worker thread."""
        router = self.router
        if messages is None:
            return router.tokenized(text)[1]
        if router.tokenizer is None:
            raise ValueError("the model has no tokenizer: send token_ids")
        checked = check_messages(messages)
        router.check_text_size(None, checked)
        ids = router.tokenizer.apply_chat_template(checked, add_generation_prompt=False, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        return check_token_ids(list(ids), router.model_info.vocab_size)[1]

    def check(self, ids: CheckedIds, ttl_s: int, groups: Sequence[str], tier: str, replicas: int = 1) -> None:
        """DocumentFieldError (a ValueError) naming the field of a document that cannot be
        pinned as asked."""
        if replicas < 1:
            raise DocumentFieldError("replicas", f"replicas must be at least 1, got {replicas}")
        if replicas > 1 and groups:
            raise DocumentFieldError("replicas", "give groups or replicas, not both: groups names where it is pinned")
        able = [gid for gid, g in list(self.router.groups.items()) if tier != "host" or _has_host_tier(g.status())]
        if replicas > max(len(able), 1):
            raise DocumentFieldError(
                "replicas", f"replicas {replicas}: the cluster has {len(able)} group(s) that can pin it"
            )
        bs, context = self.router.model_info.block_size, self.router.model_info.max_model_len
        if not 1 <= ttl_s <= MAX_TTL_S:
            raise DocumentFieldError("ttl_seconds", f"ttl_seconds must be in [1, {MAX_TTL_S}], got {ttl_s}")
        if len(ids) < bs:
            raise DocumentFieldError(
                "text", f"the document is {len(ids)} tokens, less than one block of {bs}: a pin holds whole blocks"
            )
        if len(ids) >= context:
            raise DocumentFieldError(
                "text", f"the document is {len(ids)} tokens; the model's context is {context} tokens"
            )
        if tier not in TIERS:
            raise DocumentFieldError("tier", f"tier must be one of {list(TIERS)}, got {tier[:64]!r}")
        if len(set(groups)) != len(groups):
            raise DocumentFieldError("groups", "groups names a group twice")
        for i, gid in enumerate(groups):
            if gid not in self.router.groups:
                raise DocumentFieldError(
                    f"groups[{i}]", f"groups[{i}]: no group {gid[:128]!r} (GetClusterStatus lists them)"
                )
        if tier == "host":
            lacking = [gid for gid in groups if gid not in able]
            if lacking:
                raise DocumentFieldError(
                    "tier", f"tier 'host': group {lacking[0]!r} has no host tier (--kv-host-bytes)"
                )
            if not able:
                raise DocumentFieldError("tier", "tier 'host': no group has a host tier (--kv-host-bytes)")

    def _placed(self, doc: Document, n: int, held, live: set[str] | None = None) -> list[str]:
        """`n` groups to pin `doc` on, none of `held`: the one the placement policy picks, then
        those with the most free blocks (each with a host tier, for a host pin)."""
        statuses = {gid: g.status() for gid, g in list(self.router.groups.items())}
        able = [
            gid
            for gid, s in statuses.items()
            if gid not in held
            and (live is None or gid in live)
            and s.alive
            and (doc.tier != "host" or _has_host_tier(s))
        ]
        if not able or n < 1:
            return []
        first = self.router.place(doc.hashes).group_id
        chosen = [first] if first in able else []
        rest = sorted((gid for gid in able if gid != first), key=lambda gid: (-statuses[gid].blocks_free, gid))
        return chosen + rest[: n - len(chosen)]

    def check_quota(self, owner: str | None, tenant: str) -> None:
        """DocumentLimitError when the owner holds its tenant's limit of live documents."""
        limit = self.max_documents.get(tenant, DEFAULT_MAX_DOCUMENTS)
        if self.shared is not None:
            held = self.shared.held(owner)
        else:
            held = sum(1 for d in self.docs.values() if d.owner == owner and not d.expired())
        if held >= limit:
            raise _limit_error(tenant, held)

    async def put(
        self,
        ids: CheckedIds,
        owner: str | None,
        tenant: str,
        ttl_s: int = DEFAULT_TTL_S,
        groups: Sequence[str] = (),
        tier: str = "device",
        replicas: int = 1,
    ) -> Document:
        """Register a document and prefill it pinned on its groups; returns it once every
        target holds it. Errors: ValueError (a field), DocumentLimitError, and what a group
        answers (PinRefusedError: its pins are full; EngineDeadError; NoGroupAvailableError)."""
        self.check(ids, ttl_s, groups, tier, replicas)
        self._forget_expired()
        self.check_quota(owner, tenant)
        hashes = self.router.hash_cache.hash_prompt(ids, cache_salt=owner)
        doc = Document(
            f"doc-{uuid.uuid4().hex[:24]}",
            owner,
            tenant,
            ids,
            tuple(hashes),
            ttl_s,
            time.time() + ttl_s,
            tuple(groups),
            tier,
            replicas,
        )
        if self.shared is not None:  # (counted and registered at once: no two replicas take one slot)
            held = self.shared.put(doc, self.max_documents.get(tenant, DEFAULT_MAX_DOCUMENTS))
            if held is not None:
                raise _limit_error(tenant, held)
        self.docs[doc.document_id] = doc
        self._start_reconciler()
        try:
            targets = list(groups) or self._placed(doc, replicas, held=())
            await asyncio.gather(*(self._prefill(doc, gid) for gid in targets))
        except BaseException:
            self._drop(doc)
            raise
        await self._reported(doc, targets)
        return doc

    async def _reported(self, doc: Document, targets: Sequence[str]) -> None:
        """Wait (up to REPORT_WAIT_S) for the targets' statuses to list the pin: a group's
        status follows its step by a moment (and across Ray, by a batch)."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while not set(targets) <= set(self.holders(doc)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _prefill(self, doc: Document, group_id: str) -> None:
        """Run the document's prompt on a group, one token, pinned once prefilled."""
        group = self.router.groups[group_id]
        request = GenerationRequest(
            doc.ids,
            SamplingParams(max_tokens=1, temperature=0.0),
            request_id=f"{doc.document_id}-{uuid.uuid4().hex[:8]}",
            cache_salt=doc.owner,
            block_hashes=doc.hashes,
            tenant=doc.tenant,
            pin=Pin(doc.document_id, doc.expires_at, doc.tier),
        )
        doc.prefills += 1
        try:
            async for out in group.generate(request):
                if out.finished:
                    break
        finally:
            doc.prefills -= 1
            doc.settled_at = time.monotonic()

    # ---- get, delete -------------------------------------------------------------------
    def get(self, document_id: str, owner: str | None) -> Document:
        """The caller's document; DocumentNotFoundError for an unknown id or another owner's."""
        doc = self.docs.get(document_id)
        if self.shared is not None:
            doc = self._shared_document(document_id, doc)
        if doc is None or doc.owner != owner:
            raise DocumentNotFoundError(f"document_id: no document {document_id[:64]!r}")
        return doc

    def _shared_document(self, document_id: str, known: Document | None) -> Document | None:
        """The document as Redis has it (another replica's, or gone): cached in `docs`, whose
        reconciler then keeps it pinned too; one Redis no longer has is forgotten here."""
        record = self.shared.load(document_id)
        if record is None:
            if known is not None:
                self.docs.pop(document_id, None)
            return None
        if known is not None:
            return known
        ids = CheckedIds.trusted(array("I", record["ids"]), record["vocab"])
        owner = record["owner"]
        doc = Document(
            document_id,
            owner,
            record["tenant"],
            ids,
            tuple(self.router.hash_cache.hash_prompt(ids, cache_salt=owner)),
            record["ttl_s"],
            record["expires_at"],
            tuple(record["groups"]),
            record["tier"],
            record.get("replicas", 1),
            record["created_at"],
            settled_at=time.monotonic(),  # (its pins are as fresh as its put: no re-pin at once)
        )
        self.docs[document_id] = doc
        self._start_reconciler()
        return doc

    def delete(self, document_id: str, owner: str | None) -> Document:
        """Forget the caller's document and unpin it on every group."""
        doc = self.get(document_id, owner)
        self._drop(doc)
        return doc

    def _drop(self, doc: Document) -> None:
        if self.shared is not None:  # (first: no replica pins it again once it is unpinned)
            self.shared.delete(doc)
        self.docs.pop(doc.document_id, None)
        for group in self.router.groups.values():
            group.unpin(doc.document_id)

    def state(self, doc: Document) -> str:
        if doc.expired():
            return EXPIRED
        if doc.prefills or not self.holders(doc):
            return PREFILLING
        return READY

    def holders(self, doc: Document) -> dict[str, int]:
        """Live groups holding the document pinned: group id -> blocks."""
        out = {}
        for g in list(self.router.groups.values()):
            s = g.status()
            if s.alive and doc.document_id in s.pinned:
                out[g.group_id] = s.pinned[doc.document_id]
        return out

    async def locate(self, doc: Document) -> list[Location]:
        """Where the document's blocks are: each group that pins it or caches any of it, on the
        device and, as the prefix index follows the chain further, in the tiers under it."""
        if doc.expired():
            return []
        pinned = self.holders(doc)
        index = self.router.index
        try:
            matches = index.match(doc.hashes) if index.in_process else await asyncio.to_thread(index.match, doc.hashes)
        except PrefixIndexError as e:
            log.warning("prefix index unavailable (%s); documents located by their pins", e)
            matches = {}
        out = []
        for gid in sorted(set(pinned) | {gid for gid, m in matches.items() if m.blocks or m.host_blocks}):
            m = matches.get(gid)
            pins = pinned.get(gid, 0)  # held in the tier the document names (doc.tier)
            # the device's blocks, then the chain's blocks after them, continued in the tiers under it
            cached = (m.blocks, m.host_blocks, m.disk_blocks) if m is not None else (0, 0, 0)
            for tier, n in zip(("device", "host", "disk"), cached, strict=True):
                held = pins if tier == doc.tier else 0
                if tier == "device" or n or held:
                    out.append(Location(gid, tier, held, n))
        return out

    def by_tenant(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (its live documents this router knows, the blocks its groups hold pinned
        for them): the per-tenant document metrics."""
        pinned: dict[str, int] = {}
        for g in list(self.router.groups.values()):
            s = g.status()
            if s.alive:
                for document_id, blocks in s.pinned.items():
                    pinned[document_id] = pinned.get(document_id, 0) + blocks
        out: dict[str, tuple[int, int]] = {}
        for doc in list(self.docs.values()):
            if not doc.expired():
                n, blocks = out.get(doc.tenant, (0, 0))
                out[doc.tenant] = (n + 1, blocks + pinned.get(doc.document_id, 0))
        return out

    # ---- keeping pins ------------------------------------------------------------------
    def _start_reconciler(self) -> None:
        if self._reconciler is None or self._reconciler.done():
            self._reconciler = asyncio.ensure_future(self._reconcile_forever())

    async def _reconcile_forever(self) -> None:
        while self.docs:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self.reconcile()
            except Exception:  # (the next round tries again)
                log.exception("re-pinning documents failed")

    async def reconcile(self) -> None:
        """Pin again each live document that lost its pin: on each named group that is live and
        does not hold it, or, without named groups, on a placed group once none holds it."""
        self._forget_expired()
        if self.shared is not None and self.docs:  # deleted through another replica: forgotten
            docs = list(self.docs.values())
            present = await asyncio.to_thread(self.shared.exists, [d.document_id for d in docs])
            for doc, there in zip(docs, present, strict=True):
                if not there:  # (unpinned on this replica's groups too, where they are its own)
                    self.docs.pop(doc.document_id, None)
                    for group in list(self.router.groups.values()):
                        group.unpin(doc.document_id)
        now = time.monotonic()
        for doc in list(self.docs.values()):
            if doc.expired() or doc.prefills or now - doc.settled_at < REPIN_GRACE_S:
                continue
            held = self.holders(doc)
            live = {gid for gid, g in self.router.groups.items() if g.status().alive}
            if doc.groups:
                missing = [gid for gid in doc.groups if gid in live and gid not in held]
            else:
                short = doc.replicas - len(set(held) & live)
                missing = self._placed(doc, short, held, live) if short > 0 and live else []
            for gid in missing:
                log.info("document %s is not pinned on %s any more; pinning it again", doc.document_id, gid)
                try:
                    await self._prefill(doc, gid)
                except Exception as e:  # (tried again next round)
                    log.warning("pinning document %s again on %s failed: %s", doc.document_id, gid, e)

    def _forget_expired(self) -> None:
        now = time.time()
        for doc in [d for d in self.docs.values() if now - d.expires_at > EXPIRED_KEPT_S]:
            del self.docs[doc.document_id]

    def close(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()


def _has_host_tier(status: GroupStatus) -> bool:
    """Whether a group has a host tier to pin a document in (its engine's kv_host_blocks_total)."""
    return status.tiers.get("kv_host_blocks_total", 0) > 0


def _limit_error(tenant: str, held: int) -> DocumentLimitError:
    return DocumentLimitError(
        f"max_documents: tenant {tenant or 'default'!r} holds {held} live documents, its limit; "
        "delete one or let one expire"
    )
