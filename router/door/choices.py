"""The streams of one HTTP request's choices, read at once and merged, and a client's
disconnect watched while a response is prepared.

A request with n choices (or several prompts) is n router streams. `Merged` reads them
concurrently and hands their outputs over in arrival order, each with its choice's index. A
prompt's later choices start once its first choice has its first token: by then the prompt's
blocks are in the prefix cache, and they reuse them instead of computing the prompt again.
Closing `Merged` (or cancelling what reads it) closes every stream, which aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

_END = object()  # a stream has ended


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Merged:
    """Choice i is `streams[i]`; prompt p's choices are p * n .. p * n + n - 1."""

    def __init__(self, streams: Sequence[AsyncIterator], n: int) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()  # (choice, item, _END or an exception)
        self._n = n
        self._first_out = [asyncio.Event() for _ in range(len(streams) // n)]  # per prompt
        self._open = len(streams)
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator) -> None:
        prompt, j = divmod(i, self._n)
        try:
            if j > 0:
                await self._first_out[prompt].wait()
            async with contextlib.aclosing(stream):
                async for item in stream:
                    self._queue.put_nowait((i, item))
                    if j == 0:
                        self._first_out[prompt].set()
        except Exception as e:  # handed to the reader
            self._queue.put_nowait((i, e))
        finally:
            if j == 0:
                self._first_out[prompt].set()
            self._queue.put_nowait((i, _END))

    async def _next(self) -> tuple[int, Any] | None:
        """The next (choice, item); None once every stream has ended. A stream's error is
        raised here."""
        while self._open:
            i, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return i, item
        return None

    async def prime(self) -> list[tuple[int, Any]]:
        """Read until every choice has its first item (or has ended); returns what was read
        (`items` hands over what comes after). An error of any choice is raised here."""
        seen: set[int] = set()
        primed = []
        while len(seen) < len(self._tasks):
            i, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                seen.add(i)
                continue
            if isinstance(item, Exception):
                raise item
            primed.append((i, item))
            seen.add(i)
        return primed

    async def items(self) -> AsyncIterator[tuple[int, Any]]:
        while (step := await self._next()) is not None:
            yield step

    def cancel(self) -> None:
        """Close every stream (cancelling its task aborts its request); does not wait."""
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def until_disconnected(request, work: Awaitable) -> Any:
    """`work`'s result, unless the client of `request` (a Starlette request whose body has
    been read) disconnects first: then `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


async def _disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
