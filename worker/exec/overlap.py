"""Overlapped decode steps: the next forward starts before the engine has read the last one's
tokens, so that a device never waits on the engine's own work between two forwards.

Without overlap a step is serial: schedule, prepare, forward, sample, then the engine appends
the tokens, checks stops, detokenizes and builds outputs, and only then schedules the next
step, while the device idles. In the steady state of decoding, the next step is predictable:
the same requests, each one token further, its input tokens the ones just sampled, which the
runner already holds (`RowPlanner.commit` builds that step, `ModelRunner.speculate`
advances its arrays; what carries over is worker/exec/persistent_batch.py's). So a forward thread runs that step's forward right after sampling, and
hands the sampled tokens back; the engine does its work meanwhile, schedules, and when its
scheduler's step is the predicted one (`RowPlanner.plan` returns the step built ahead,
marked `FlatStep.ahead`), that forward is adopted. When it is not (a request stopped on EOS or a stop string, one was
aborted or admitted), the predicted forward is discarded and the scheduler's step runs; what it
wrote to the KV pool is what the real step writes for the same tokens at the same positions, or
lies in a finished request's last, partial block, which no cached prefix holds and which a
later owner writes before it reads (the real step runs only after the predicted one ended).
vLLM's asynchronous scheduling overlaps the same way, its scheduler counting placeholders.

A forward runs ahead only when nothing it needs can change meanwhile: a one-token step in which
every request sampled; no request reaching `max_tokens` in the step before; no position
entering a block the table lacks (the scheduler allocates each decode's next block a step
early, `Scheduler.lookahead`, and its entries travel with the step built ahead next, so that
only a pool without a free block stops a forward there); and sampling rows that do not
read the output so far (no penalties, no suppressed EOS before `min_tokens`), so that the same
rows serve again. What a row's sampling does follow, the runner keeps itself: a seeded draw's
position and a structured output's matcher advance on the forward thread once a step's tokens
are adopted (`ModelRunner.advance`), never with a discarded forward's; the next step's masks
are filled on a thread of their own while its forward runs (`ModelRunner.start_masks`), so a
constrained row costs its neighbours only the mask's application, and a batch with one runs
ahead like any other. Greedy and seeded requests, constrained or not, give the same tokens
with and without overlap (tests/test_overlap.py); an unseeded random request draws from the
global generator, whose draws a discarded forward consumes.

The engine's thread plans (it alone touches the planner while a forward is unconfirmed); the
forward thread prepares, runs, samples and, once a step is confirmed, commits its tokens and
starts the next. A single device only: a tensor-parallel group's ranks follow rank 0's steps.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.exec.model_runner import ModelRunner, Sampled, SamplingRows, sampled_by_id
from worker.exec.sampler import SampleResult
from worker.exec.step_codec import FlatStep
from worker.step import KVMoves, SchedulerOutput

_DISCARDED: Sampled = {}  # the result of a forward run ahead and not adopted


@dataclass
class _Job:
    """A step for the forward thread to run, and how far it may run ahead after it."""

    step: FlatStep
    rows: SamplingRows  # its sampling rows, which serve the steps run ahead too
    horizon: int  # steps every request can still take after this one


@dataclass
class _Result:
    """What the forward thread hands back for one step."""

    # the step's (sample ids, sampler result), a discarded forward's empty result, or an error
    sampled: tuple[Sequence[str], SampleResult | None] | Sampled | BaseException
    ahead: FlatStep | None  # the step it started ahead, running now (not yet confirmed)


class OverlapRunner:
    """A ModelRunner driven by a forward thread that runs the predicted next step ahead.

    The two threads hand each other work through three queues (C-level, no Python lock or
    waiter list on the path between two forwards): jobs and verdicts go to the forward thread,
    results come back."""

    def __init__(self, runner: ModelRunner, move: Callable[[KVMoves | None], None] | None = None) -> None:
        self.runner = runner
        # a step's copies between the KV pool and a tier under it (worker/step.py KVMoves):
        # made on the engine's thread once no forward that could write their blocks runs
        self._move = move or _no_moves
        self.confirmed = 0  # forwards run ahead and adopted
        self.discarded = 0  # forwards run ahead whose step the scheduler did not make
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        # the engine's word on the forward running ahead (adopt it or not), None to stop
        self._verdicts: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._ahead: FlatStep | None = None  # running ahead, not yet confirmed
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pagefleet-forward", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    # ---- the engine's thread -----------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> Sampled:
        """Run the scheduler's step (adopting the forward run ahead when it is that step);
        returns the sampled token (and logprobs) of each sampling request."""
        runner = self.runner
        step = runner.plan(out)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if step.ahead:  # its copies are saves only (no admission): the blocks they read
                # are cached, which no forward writes; the next forward starts after the verdict
                self._move(out.moves)
                self._verdicts.put(True)
                self.confirmed += 1
                return self._take()
            self._verdicts.put(False)
            self.discarded += 1
            self._take()  # wait for it to end (a load may fill a block it was writing)
        self._move(out.moves)
        if not step.num_seqs:
            return {}
        rows = runner.rows_of(step, out)
        horizon = 0  # steps every request can still take after this one
        if step.samples is None and step.q_lens is None and _plain(rows):
            horizon = min(s.request.max_tokens - s.request.num_output_tokens for s in out.scheduled)
        self._jobs.put(_Job(step, rows, horizon))
        return self._take()

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._jobs.put(None)  # (whichever the forward thread waits on)
        self._verdicts.put(None)
        self._thread.join(timeout)

    def _take(self) -> Sampled:
        got = self._results.get()
        result, self._ahead = got.sampled, got.ahead
        if isinstance(result, BaseException):
            raise result
        return result if isinstance(result, dict) else sampled_by_id(*result)

    # ---- the forward thread ------------------------------------------------------------
    def _loop(self) -> None:
        device = self.runner.device
        if device.type == "cuda" and device.index is not None:  # (a thread starts on device 0)
            torch.cuda.set_device(device)
        with torch.inference_mode():
            while (job := self._jobs.get()) is not None:
                try:
                    self._chain(job.step, job.rows, job.horizon)
                except BaseException as e:  # handed to the engine's thread, raised there
                    self._results.put(_Result(e, None))

    def _chain(self, step: FlatStep, rows: SamplingRows, horizon: int) -> None:
        """Run `step`, then, while the engine confirms each prediction, the steps after it."""
        runner = self.runner
        inputs = runner.prepare(step)
        predicted = False
        while True:
            masks = runner.start_masks(rows)  # the constrained rows', filled beside the forward
            hidden = runner.forward(inputs)
            result, tokens = runner.sample_tokens(step, inputs, hidden, rows, masks)
            sampled = (inputs.sample_ids, result)  # keyed by id on the engine's thread
            if predicted and not self._verdicts.get():  # (None: closing)
                self._results.put(_Result(_DISCARDED, None))
                return
            runner.advance(rows, result)  # the rows and grammars follow only adopted tokens
            runner.commit(tokens)
            nxt = None
            if tokens is not None and horizon > 1 and not self._closed:
                nxt = runner.planner.ahead()
            if nxt is not None:
                inputs = runner.prepare(nxt)  # before the engine wakes: it plans from here
            self._results.put(_Result(sampled, nxt))
            if nxt is None:
                return
            step, predicted, horizon = nxt, True, horizon - 1


_RUNNING: weakref.WeakSet[OverlapRunner] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """End every forward thread before the interpreter does: one left inside a torch call
    while the process tears down its C++ state aborts it ("terminate called ...")."""
    for runner in list(_RUNNING):
        runner.close(timeout=5.0)


def _no_moves(moves: KVMoves | None) -> None:
    assert not moves, "a step moved KV blocks to a tier this runner has no copier for"


def _plain(rows: SamplingRows) -> bool:
    """Whether the rows serve the next step too without reading the output so far, which the
    engine's thread appends while a forward runs ahead: no penalties (they read the output's
    tokens) and nothing suppressed (min_tokens: which ids changes with the output's length).
    A seeded draw's position and a grammar's state are the runner's own, advanced with each
    step it adopts (`ModelRunner.advance`)."""
    return not any(row.suppressed or row.params.has_penalties for row in rows.rows)


def wants_overlap(setting: bool | None, device: torch.device) -> bool:
    """The scheduler's `overlap` setting resolved for a device (None: on for CUDA)."""
    return device.type == "cuda" if setting is None else setting


__all__ = ["OverlapRunner", "wants_overlap"]
