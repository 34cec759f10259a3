"""Messages of the gRPC API to and from the router's types, with the checks of the front door.

Every rejection names the field as a client wrote it (`sampling.top_p`, `token_ids[3]`,
`messages[1].role`), with the status a client can act on: INVALID_ARGUMENT for a bad value,
OUT_OF_RANGE for a prompt (or prompt + max_tokens) beyond the model's context.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from router.door.serving import (
    check_message_count,
    checked_request,
    invalid,
    request_salt,
    tokenize,
)
from router.router import CheckedRequest
from worker.outputs import TokenLogprobs
from worker.protocol import Resume
from worker.sampling_params import SamplingParams, shown
from worker.structured_outputs import StructuredOutputs
from worker.token_ids import CheckedIds, first_outside

if TYPE_CHECKING:
    from cluster.group import GroupStatus
    from router.router import ModelInfo, Router, RouteRecord
    from worker.outputs import RequestOutput

_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_TENANT = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_SAMPLING_FIELDS = tuple(n for n in pb.SamplingParams.DESCRIPTOR.fields_by_name if n != "structured_output")
_CONSTRAINT = "sampling.structured_output"  # how a group's errors about it are named here
_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


async def route_request(
    request: pb.GenerateRequest, router: Router, default_id: str, key_tenant: str | None = None
) -> tuple[CheckedRequest, int]:
    """The checked request (prompt as token ids) and the requested output kind. Text and
    chat prompts are tokenized on a worker thread: a long one must not stall the event loop,
    which serves every other call (health checks included). `key_tenant`: the tenant of the
    call's API key, when keys are configured (see `cache_salt`)."""
    if request.request_id and not _REQUEST_ID.fullmatch(request.request_id):
        raise invalid(f"request_id must match {_REQUEST_ID.pattern}, got {shown(request.request_id)}")
    if request.output_kind not in pb.OutputKind.values():
        raise invalid(f"output_kind {request.output_kind} is not a known OutputKind value")
    params = sampling_params(request.sampling)
    salt = cache_salt(request, key_tenant)
    ids = await prompt_token_ids(request, router)
    resume = resume_from(request.resume, params, router.model_info.vocab_size) if request.HasField("resume") else None
    rid = request.request_id or default_id
    tenant = key_tenant or request.tenant  # (cache_salt checked that they agree)
    route = checked_request(router, ids, params, rid, request.priority, salt, resume, tenant=tenant)
    return route, request.output_kind


def resume_from(msg: pb.ResumeFrom, params, vocab_size: int):
    """The `Resume` of a stream continued from another router (what it had delivered),
    checked: 1 to max_tokens - 1 tokens in the vocabulary, a text length >= 0, and one logprob
    per token exactly when the request asks for logprobs."""
    n = len(msg.token_ids)
    if not 0 < n < params.max_tokens:
        raise invalid(f"resume.token_ids has {n} tokens; give 1 to max_tokens - 1 ({params.max_tokens - 1})")
    if (i := first_outside(np.array(msg.token_ids, dtype=np.int64), vocab_size)) is not None:
        raise invalid(f"resume.token_ids[{i}] = {msg.token_ids[i]} is outside the vocabulary [0, {vocab_size})")
    if msg.text_chars < 0:
        raise invalid(f"resume.text_chars must be >= 0, got {msg.text_chars}")
    asked = params.logprobs is not None
    if len(msg.logprobs) != (n if asked else 0):
        want = f"{n} (one per token)" if asked else "none (the request asks for no logprobs)"
        raise invalid(f"resume.logprobs has {len(msg.logprobs)} entries; give {want}")
    logprobs = tuple(
        TokenLogprobs(lp.token_id, lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top])
        for lp in msg.logprobs
    )
    return Resume(tuple(msg.token_ids), msg.text_chars, logprobs)


def sampling_params(msg: pb.SamplingParams):
    """`SamplingParams` from the fields the client set; its ValueError names the field."""
    values = {}
    for name in _SAMPLING_FIELDS:
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.has_presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        values[name] = tuple(value) if field.is_repeated else value
    if msg.HasField("structured_output"):
        values["structured_outputs"] = structured_output(msg.structured_output)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise invalid(str(e).replace("SamplingParams.", "sampling.")) from None


def structured_output(msg: pb.StructuredOutput) -> StructuredOutputs:
    """The constraint of `sampling.structured_output` (exactly one kind set)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise invalid(f"{_CONSTRAINT} is set but none of its fields is")
    value = getattr(msg, kind)
    try:
        return StructuredOutputs(**{kind: tuple(value.choices) if kind == "choice" else value})
    except ValueError as e:
        raise invalid(constraint_named(str(e))) from None


def constraint_named(message: str) -> str:
    """An error about a structured output, naming the gRPC field (a group names the
    constraint `StructuredOutputs.<field>`)."""
    return message.replace("StructuredOutputs", _CONSTRAINT)


async def prompt_token_ids(request: pb.GenerateRequest, router: Router) -> CheckedIds:
    """The prompt as token ids: exactly one of text, token_ids or messages."""
    given = [
        name
        for name, present in (
            ("text", request.HasField("text")),
            ("token_ids", len(request.token_ids) > 0),
            ("messages", len(request.messages) > 0),
        )
        if present
    ]
    if len(given) != 1:
        got = " and ".join(given) or "none"
        raise invalid(f"give exactly one of text, token_ids or messages (got {got})")
    if request.HasField("text") and not request.text:
        raise invalid("text is empty")
    if request.token_ids:
        # (n,) int64, one C copy of the repeated field (cheaper than list() of it or a Python
        # loop over it: benchmarks/RESULTS.md).
        ids = np.array(request.token_ids, dtype=np.int64)
        vocab = router.model_info.vocab_size
        if (i := first_outside(ids, vocab)) is not None:
            raise invalid(f"token_ids[{i}] = {ids[i]} is outside the vocabulary [0, {vocab})")
        return CheckedIds.trusted(ids, vocab)  # checked here, trusted below
    return await tokenized(request, router)


async def tokenized(request: pb.GenerateRequest | pb.TokenizeRequest, router: Router) -> CheckedIds:
    """The token ids of the request's text or chat messages (router/door/serving.py: tokenize)."""
    check_message_count(len(request.messages), router.model_info.max_model_len)  # before dicts
    messages = [chat_message(i, m) for i, m in enumerate(request.messages)] or None
    text = request.text if request.HasField("text") else None
    return await tokenize(router, text=text, messages=messages)


def chat_message(i: int, m: pb.ChatMessage) -> dict:
    if not m.role.strip():
        raise invalid(f"messages[{i}].role must not be empty")
    return {"role": m.role, "content": m.content}


def cache_salt(request: pb.GenerateRequest, key_tenant: str | None = None) -> str | None:
    """The salt the request's blocks are keyed by: its API key's tenant when keys are
    configured, else its tenant's or its cache_salt's (router/door/serving.py: request_salt)."""
    tenant = request.tenant
    if tenant and not _TENANT.fullmatch(tenant):
        raise invalid(f"tenant must match {_TENANT.pattern}, got {shown(tenant)}")
    return request_salt(key_tenant, cache_salt=request.cache_salt, tenant=tenant)


# ---- responses ---------------------------------------------------------------------------


def response_message(
    out: RequestOutput,
    kind: int,
    record: RouteRecord | None,
    e2e_seconds: float,
    resumes: int = 0,
) -> pb.GenerateResponse:
    """One stream message: this step's delta (or, FINAL_ONLY, the whole output); the placement
    with `record` (the first message), the usage when finished."""
    final_only = kind == pb.OUTPUT_KIND_FINAL_ONLY
    ids = out.token_ids if final_only else out.new_token_ids
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=ids,
        text=out.text if final_only else out.new_text,
        finished=out.finished,
    )
    logprobs = out.logprobs if final_only else out.new_logprobs  # (the whole list grows on)
    if logprobs is not None:
        msg.logprobs.extend(_logprob(lp) for lp in logprobs)
    if record is not None:
        msg.placement.CopyFrom(
            pb.Placement(
                group_id=record.group_id,
                reason=record.reason,
                predicted_cached_tokens=record.predicted_cached_tokens,
                predicted_cached_tiers=pb.CachedTiers(**record.predicted_tiers.as_dict()),
            )
        )
    if out.finished:
        msg.finish_reason = _FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        if isinstance(out.stop_reason, str):
            msg.stop_string = out.stop_reason
        elif isinstance(out.stop_reason, int):
            msg.stop_token_id = out.stop_reason
        m = out.metrics
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=len(out.token_ids),
                cached_tokens=out.num_cached_tokens,
                ttft_seconds=m.ttft or 0.0,
                resumes=resumes,
                queue_seconds=m.queue_time or 0.0,
                e2e_seconds=e2e_seconds,
            )
        )
        if out.cached_tiers is not None:
            msg.usage.cached_tiers.CopyFrom(pb.CachedTiers(**out.cached_tiers.as_dict()))
    return msg


def _logprob(lp) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=top)


def model_info_message(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        kv_cache_dtype=info.kv_cache_dtype,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
    )


def status_message(s: GroupStatus) -> pb.GroupStatus:
    return pb.GroupStatus(
        group_id=s.group_id,
        alive=s.alive,
        tensor_parallel_size=s.tensor_parallel_size,
        devices=list(s.devices),
        blocks_total=s.blocks_total,
        blocks_free=s.blocks_free,
        blocks_cached=s.blocks_cached,
        running=s.running,
        waiting=s.waiting,
        pending_prefill_tokens=s.pending_prefill_tokens,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        preemptions=s.preemptions,
        error=s.error or "",
        draining=s.draining,
        state=s.state,
        generation=s.generation,
        restarts=s.restarts,
    )
