"""The engine behind asyncio: a loop thread steps the engine; callers stream their outputs.

All engine calls happen on the loop thread (the engine is not thread-safe); callers talk to it
through a command queue, and each request's outputs come back on an asyncio queue of the
caller's event loop. Leaving a stream early (cancellation, a deadline, a dropped client) aborts
the request, so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable

from worker.engine.llm_engine import LLMEngine
from worker.outputs import RequestOutput
from worker.protocol import EngineDeadError, GenerationRequest

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread for asyncio callers."""

    def __init__(
        self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the loop thread after every step (and when idle)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.dead: BaseException | None = None
        self._stats: dict = engine.stats()
        self._thread = threading.Thread(target=self._run, name="pagefleet-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) -----------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has `finished=True`."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        rid = request.request_id or f"req-{id(request):x}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._send(("add", rid, request))
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

    def abort(self, request_id: str) -> None:
        """Stop the request; its stream, if still open, ends with a final output whose
        finish_reason is "abort"."""
        self._send(("abort", request_id, None))

    def stats(self) -> dict:
        """The engine's stats as of the latest step."""
        return dict(self._stats)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                self._stats = self.engine.stats()
                if self.on_step is not None:
                    self.on_step(self.engine)
        except BaseException as e:  # the engine is unusable: fail everyone, loudly
            log.error("engine loop died:\n%s", traceback.format_exc())
            self.dead = e
            err = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            for rid in list(self._streams):
                self._deliver(rid, err)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, rid, request = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":  # a stream still open gets its final output ("abort")
                for out in self.engine.abort(rid):
                    self._deliver(out.request_id, out)
                continue
            try:
                self.engine.add_request(
                    request.prompt, request.params, request_id=rid, priority=request.priority,
                    cache_salt=request.cache_salt, block_hashes=request.block_hashes,
                    resume=request.resume,
                )  # fmt: skip
            except Exception as e:  # bad input or a full queue: that caller's error only
                self._deliver(rid, e)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(rid)
        if target is None:
            return
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            self._streams.pop(rid, None)
