"""The engine behind asyncio: a loop thread steps the engine; callers stream their outputs.

All engine calls happen on the loop thread (the engine is not thread-safe); callers talk to it
through a command queue, and each request's outputs come back on an asyncio queue of the
caller's event loop. Leaving a stream early (cancellation, a deadline, a dropped client) aborts
the request, so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from worker.outputs import RequestOutput
from worker.protocol import EngineDeadError, GenerationRequest

if TYPE_CHECKING:  # (the router process imports `hand_over` and must not load torch)
    from worker.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread for asyncio callers."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the loop thread after every step (and when idle)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (the caller's loop, what takes each output there: a stream's queue or a
        # `submit` caller's callback, and whether the engine ends the entry at the last one)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Callable, bool]] = {}
        self._stopped = False
        self.dead: BaseException | None = None
        self._stats: dict = engine.stats()
        self._thread = threading.Thread(target=self._run, name="pagefleet-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) -----------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has `finished=True`."""
        q: asyncio.Queue = asyncio.Queue()
        rid = self._start(request, q.put_nowait, ends=False)  # (the stream ends its entry)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send(("abort", rid, None))

    def submit(self, request: GenerationRequest, on_output: Callable[[RequestOutput | BaseException], None]) -> str:
        """Start a request whose outputs are passed to `on_output` on the calling thread's event
        loop, up to the finished one, or its error (bad input, a dead engine) instead. A step's
        outputs reach a loop in one wake-up, and a callback costs far less than a stream's
        task waking per output: the form for a caller that relays many requests (a group's
        rank 0). `abort` ends it early (its final output follows). Returns the request id."""
        return self._start(request, on_output, ends=True)

    def _start(self, request: GenerationRequest, put: Callable, ends: bool) -> str:
        """Open the request's entry (its outputs go to `put` on this thread's loop) and queue
        it for the engine; refuses a dead engine or an id in use."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        rid = request.request_id or f"req-{id(request):x}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._streams[rid] = (asyncio.get_running_loop(), put, ends)
        self._send(("add", rid, request))
        return rid

    def abort(self, request_id: str) -> None:
        """Stop the request; its stream, if still open, ends with a final output whose
        finish_reason is "abort"."""
        self._send(("abort", request_id, None))

    def unpin(self, document_id: str) -> None:
        """Release a document's pinned blocks (worker/protocol.py: Pin), between steps."""
        self._send(("unpin", document_id, None))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop thread between two steps, in order with the requests
        sent before and after it; its result (or error) in the future."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            done.set_exception(EngineDeadError(f"engine is dead: {self.dead}"))
        else:
            self._send(("call", None, (fn, done)))
        return done

    def stats(self) -> dict:
        """The engine's stats as of the latest step."""
        return dict(self._stats)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the loop thread, which ends the engine (`LLMEngine.shutdown`: its KV tiers
        written down to the disk, within llm_engine.FLUSH_WITHIN_S); True when it ended within
        `timeout` (False: it is stuck, e.g. in a collective, and what it holds must not be
        torn down under it)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if self.engine.has_unfinished():
                    self._deliver([(out.request_id, out) for out in self.engine.step()])
                    self._deliver(self.engine.take_failures())  # (a constraint refused, say)
                else:
                    self.engine.flush_events()  # (what it reopened at start-up, say)
                    self._wake.wait(0.05)
                    self._wake.clear()
                self.engine.expire_pins()
                self._stats = self.engine.stats()
                if self.on_step is not None:
                    self.on_step(self.engine)
            # a clean stop: the tiers' blocks go down to the disk (bounded), on this thread,
            # as every call into the engine; a dead engine's group may not follow: no flush
            self.engine.shutdown()
        except BaseException as e:  # the engine is unusable: fail everyone, loudly
            log.error("engine loop died:\n%s", traceback.format_exc())
            self.dead = e
            err = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            self._deliver([(rid, err) for rid in list(self._streams)])

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, rid, request = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":  # a stream still open gets its final output ("abort")
                self._deliver([(out.request_id, out) for out in self.engine.abort(rid)])
                continue
            if kind == "unpin":  # (`rid`: the document's id)
                self.engine.unpin(rid)
                continue
            if kind == "call":
                fn, done = request
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # (the caller's to handle)
                    done.set_exception(e)
                continue
            try:
                self.engine.add_request(
                    request.prompt,
                    request.params,
                    request_id=rid,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    block_hashes=request.block_hashes,
                    resume=request.resume,
                    tenant=request.tenant,
                    pin=request.pin,
                )
            except Exception as e:  # bad input or a full queue: that caller's error only
                self._deliver([(rid, e)])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Each (request id, output or error) to its caller, a loop's all at once (a step's
        outputs in one wake-up: `hand_over`); a `submit` entry ends with its last output or
        its error."""
        deliveries = []
        streams = self._streams
        for rid, item in items:
            target = streams.get(rid)
            if target is not None:
                loop, put, ends = target
                deliveries.append((loop, put, item))
                if ends and (isinstance(item, BaseException) or item.finished):
                    del streams[rid]
        for loop in hand_over(deliveries):  # (closed: their callers are gone)
            for rid in [r for r, (lp, _, _) in list(streams.items()) if lp is loop]:
                streams.pop(rid, None)


def hand_over(
    deliveries: Iterable[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any]],
) -> list[asyncio.AbstractEventLoop]:
    """From another thread: `put(item)` on `loop` for each (loop, put, item), in order, with
    one wake-up per loop rather than one per item (each `call_soon_threadsafe` writes to the
    loop's self-pipe, and a step hands over an output per running request). A `put` that
    raises is logged; the others still run. Returns the loops found closed."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for loop, put, item in deliveries:
        puts = by_loop.get(loop)
        if puts is None:
            puts = by_loop[loop] = []
        puts.append((put, item))
    closed = []
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # the loop is closed
            closed.append(loop)
    return closed


def _put_all(puts: list[tuple[Callable[[Any], None], Any]]) -> None:
    for put, item in puts:
        try:
            put(item)
        except Exception:
            log.exception("the receiver of %r failed", getattr(item, "request_id", item))
