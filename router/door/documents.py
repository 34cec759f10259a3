"""Documents at both doors: `POST /v1/documents`, `GET` and `DELETE /v1/documents/{id}` on HTTP,
`PutDocument`, `GetDocument` and `DeleteDocument` on gRPC, over the router's registry
(router/documents.py).

The owner of a document is the salt its blocks are keyed by, worked out as a request's is
(router/door/serving.py: `request_salt`): the API key's tenant, or without keys the `tenant` or
`cache_salt` the caller gives (HTTP: `cache_salt`, in the body of a put and as a query
parameter of a get or delete), so that a request of the same owner hits the document. Another
owner's id answers NOT_FOUND (HTTP 404), as an unknown one does: ids do not leak. Errors name
the field: a bad body or TTL, INVALID_ARGUMENT (400); too many documents for the tenant, or
pins over the group's share, RESOURCE_EXHAUSTED (429).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from router.documents import (
    DEFAULT_TTL_S,
    EXPIRED,
    PREFILLING,
    READY,
    Document,
    DocumentFieldError,
    DocumentLimitError,
    DocumentNotFoundError,
    Location,
)
from router.door.api import cache_salt as grpc_salt
from router.door.api import chat_message
from router.door.openai_protocol import INT64, ChatMessage, Text, TokenIds, error_body
from router.door.openai_routes import chat_messages
from router.door.serving import Reject, check_message_count, invalid, request_salt, status_for
from router.router import PromptTooLongError
from worker.protocol import PinRefusedError
from worker.token_ids import check_token_ids

if TYPE_CHECKING:
    from router.door.http import HttpDoor
    from router.door.server import PageFleetServicer
    from router.router import Router

_STATES = {PREFILLING: pb.DOCUMENT_STATE_PREFILLING, READY: pb.DOCUMENT_STATE_READY, EXPIRED: pb.DOCUMENT_STATE_EXPIRED}


class DocumentBody(BaseModel):
    """`POST /v1/documents`: exactly one of text, token_ids or messages (checked strictly, an
    unknown field refused, as the OpenAI bodies are: router/door/openai_protocol.py)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None
    text: Text | None = None
    token_ids: TokenIds | None = None
    messages: list[ChatMessage] | None = None
    ttl_seconds: Annotated[int, INT64] = DEFAULT_TTL_S
    groups: list[Text] = Field(default_factory=list)
    tier: Text = "device"
    replicas: Annotated[int, INT64] = 1
    cache_salt: Text | None = None


# ---- what both doors share -----------------------------------------------------------------


async def put(
    router: Router,
    text: str | None,
    token_ids,
    messages: list[dict] | None,
    owner: str | None,
    tenant: str,
    ttl_s: int,
    groups: list[str],
    tier: str,
    replicas: int = 1,
) -> Document:
    """Register and pin a document (errors as `Reject`s naming the field)."""
    given = [text is not None, token_ids is not None and len(token_ids) > 0, bool(messages)]
    if sum(given) != 1:
        raise invalid("give exactly one of text, token_ids or messages", "text")
    store = router.documents
    try:
        if token_ids is not None and len(token_ids):
            try:
                ids = check_token_ids(token_ids, router.model_info.vocab_size)[1]
            except ValueError as e:
                raise invalid(f"token_ids: {e}".replace("prompt token id", "token id"), "token_ids") from None
        else:
            ids = await asyncio.to_thread(store.document_ids, text, messages)
        return await store.put(ids, owner, tenant, ttl_s, groups, tier, replicas)
    except Exception as e:
        raise rejected(e) from None


def rejected(e: Exception) -> Reject:
    """A document operation's error as the door's status, naming the field."""
    if isinstance(e, Reject):
        return e
    if isinstance(e, DocumentFieldError):
        return invalid(str(e), e.field)
    if isinstance(e, DocumentNotFoundError):
        return Reject(grpc.StatusCode.NOT_FOUND, str(e), "document_id")
    if isinstance(e, DocumentLimitError):
        return Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), "max_documents")
    if isinstance(e, PinRefusedError):
        return Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the document cannot be pinned: {e}", "token_ids")
    if isinstance(e, PromptTooLongError):
        return Reject(grpc.StatusCode.OUT_OF_RANGE, str(e), "text")
    if isinstance(e, ValueError):
        return invalid(str(e))
    code, message = status_for(e, "document")
    return Reject(code, message)


def described(router: Router, doc: Document, locations: list[Location]) -> dict:
    """The document as the HTTP door answers it."""
    return {
        "id": doc.document_id,
        "object": "document",
        "state": router.documents.state(doc),
        "tokens": len(doc.ids),
        "blocks": doc.num_blocks,
        "ttl_seconds": doc.ttl_s,
        "created_at": doc.created_at,
        "expires_at": doc.expires_at,
        "tier": doc.tier,
        "groups": list(doc.groups),
        "replicas": doc.replicas,
        "locations": [
            {"group_id": x.group_id, "tier": x.tier, "blocks_pinned": x.blocks_pinned, "blocks_cached": x.blocks_cached}
            for x in locations
        ],
    }


# ---- HTTP ----------------------------------------------------------------------------------


def add_document_routes(app: FastAPI, door: HttpDoor) -> None:
    """The documents' routes on the HTTP door's app."""

    @app.post("/v1/documents")
    async def put_document(request: Request) -> Response:
        tenant = door.caller(request)
        body = await door.body(request, DocumentBody)
        router = door.ready(body.model)
        owner = request_salt(tenant, cache_salt=body.cache_salt)
        messages = None
        if body.messages is not None:
            messages = chat_messages(body.messages, router.model_info.max_model_len)
        doc = await put(
            router,
            body.text,
            body.token_ids,
            messages,
            owner,
            tenant or "",
            body.ttl_seconds,
            body.groups,
            body.tier,
            body.replicas,
        )
        return JSONResponse(described(router, doc, await router.documents.locate(doc)))

    @app.get("/v1/documents/{document_id}")
    async def get_document(document_id: str, request: Request) -> Response:
        router, doc = _http_document(door, request, document_id)
        if isinstance(doc, Response):
            return doc
        return JSONResponse(described(router, doc, await router.documents.locate(doc)))

    @app.delete("/v1/documents/{document_id}")
    async def delete_document(document_id: str, request: Request) -> Response:
        router, doc = _http_document(door, request, document_id, delete=True)
        if isinstance(doc, Response):
            return doc
        return JSONResponse({"id": doc.document_id, "object": "document", "deleted": True})


def _http_document(door: HttpDoor, request: Request, document_id: str, delete: bool = False):
    """(router, the caller's document), or (router, a 404 response)."""
    tenant = door.caller(request)
    router = door.ready()
    owner = request_salt(tenant, cache_salt=request.query_params.get("cache_salt"))
    store = router.documents
    try:
        return router, store.delete(document_id, owner) if delete else store.get(document_id, owner)
    except DocumentNotFoundError as e:
        door.observe_error(grpc.StatusCode.NOT_FOUND.name)
        body = error_body(grpc.StatusCode.NOT_FOUND, str(e), "document_id")
        body["error"]["code"] = "document_not_found"
        return router, JSONResponse(body, 404)


# ---- gRPC ----------------------------------------------------------------------------------


async def grpc_put(servicer: PageFleetServicer, request, context) -> pb.Document:
    router, tenant = await servicer._ready(request, context)
    try:
        owner = grpc_salt(request, tenant)
        check_message_count(len(request.messages), router.model_info.max_model_len)
        messages = [chat_message(i, m) for i, m in enumerate(request.messages)] or None
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else DEFAULT_TTL_S
        text = request.text if request.HasField("text") else None
        ids = list(request.token_ids) or None
        doc = await put(
            router,
            text,
            ids,
            messages,
            owner,
            tenant or request.tenant,
            ttl,
            list(request.groups),
            request.tier or "device",
            request.replicas or 1,
        )
    except Reject as r:
        await servicer._abort(context, r.code, r.message)
    return document_message(router, doc, await router.documents.locate(doc))


async def grpc_get(servicer: PageFleetServicer, request, context, delete: bool = False):
    router, tenant = await servicer._ready(request, context)
    try:
        owner = grpc_salt(request, tenant)
        store = router.documents
        doc = store.delete(request.document_id, owner) if delete else store.get(request.document_id, owner)
    except (Reject, DocumentNotFoundError) as e:
        r = rejected(e)
        await servicer._abort(context, r.code, r.message)
    if delete:
        return pb.DeleteDocumentResponse(document_id=doc.document_id, deleted=True)
    return document_message(router, doc, await router.documents.locate(doc))


def document_message(router: Router, doc: Document, locations: list[Location]) -> pb.Document:
    return pb.Document(
        document_id=doc.document_id,
        state=_STATES[router.documents.state(doc)],
        tokens=len(doc.ids),
        blocks=doc.num_blocks,
        ttl_seconds=doc.ttl_s,
        created_at=doc.created_at,
        expires_at=doc.expires_at,
        tier=doc.tier,
        groups=list(doc.groups),
        replicas=doc.replicas,
        locations=[
            pb.DocumentLocation(
                group_id=x.group_id, tier=x.tier, blocks_pinned=x.blocks_pinned, blocks_cached=x.blocks_cached
            )
            for x in locations
        ],
    )
