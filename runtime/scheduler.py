"""Continuous batching over an engine's slots: requests join and leave between steps.

A `Scheduler` owns an `Engine` built with `slots=N` (nobody else may call the engine once it started):
its thread admits waiting requests into free slots, then advances every running request by one token
per step, and frees a slot as soon as its request finished, was cancelled or failed. A newly admitted
request's prompt is prefilled in parts, at most `prefill_chunk` prompt tokens a step (shared by the requests
prefilling, first admitted first) after the step's decode: so a long prompt delays the running requests' next
tokens by one part's time, not by its whole prefill, and a request whose client left stops at the next part.
Requests beyond the free slots wait in a bounded queue; `submit` refuses one more with `QueueFull`.

A slot's cache outlives its request: a new request goes to the free slot whose cache holds the longest prefix
of its prompt (a shared system prompt, the earlier turns of a conversation), else to the slot used least
recently, and its prefill runs from where that prefix ends (`Engine.resume`); so the caches of `parallel`
conversations are kept, the oldest given up first.

Every running request past its prefill advances in one `Engine.forward_batch` per step: on an artifact with a
batch phase one program over all of them, whose sparse layers read the union of their predicted neurons once
(an artifact without one runs it as a decode step per slot); the newly admitted requests' prefills run one
per slot. A request joins the batch at the step after its prefill's last part.

Events reach the submitter through its callback, called on the scheduler's thread: a `TokenEvent` per
generated token, then exactly one `FinishEvent`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .sampling import prefill_part, sample, start_prompt

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# prompt tokens prefilled a step by default: a 448-token prompt's first token comes 3% later in parts of 128 than
# whole (the real 0.5B file on 2 cores; parts of 64: 30%), and a part's time (0.5 s there) bounds the stall
PREFILL_CHUNK = 128


@dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens, and when it ends."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()  # a sampled id in here ends the request ("stop"); it is not emitted


@dataclass(frozen=True)
class TokenEvent:
    token_id: int


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # one of FINISH_REASONS
    prompt_tokens: int
    completion_tokens: int  # tokens sampled, a stop id included
    error: str | None = None  # reason "error": what failed
    unavailable: bool = False  # reason "error": the engine could not run now (EngineUnavailable); a retry may work


class EngineUnavailable(RuntimeError):
    """The engine could not run a step now (a stage of a split model died), not a fault of the request: Ray
    restarts what died, and the same request sent again may be answered."""


class QueueFull(Exception):
    """Every slot is busy and the queue holds as many requests as it may."""


class SchedulerClosed(Exception):
    """The scheduler is shutting down and takes no new requests."""


class Job:
    """One request: its prompt, its sampling, and where its events go."""

    def __init__(self, prompt_ids, sampling: Sampling, on_event: Callable[[TokenEvent | FinishEvent], None],
                 cache_prompt: bool = True):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.sampling = sampling
        self.cache_prompt = cache_prompt  # False: prefilled whole, whatever its slot's cache holds
        self.on_event = on_event
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop generating; the scheduler frees the job's slot (or queue place) at its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class _Running:
    job: Job
    rng: np.random.Generator | None
    generated: int = 0
    prefilled: int | None = None  # of the prompt's tokens, those the slot's cache holds (None: not started)
    last_token: int | None = None  # None until the prompt's prefill ran


@dataclass(frozen=True)
class SchedulerStats:
    slots: int
    slots_busy: int
    queue_depth: int
    queue_size: int
    requests_submitted: int
    requests_finished: dict[str, int]  # by finish reason
    prompt_tokens: int
    prompt_tokens_cached: int  # of prompt_tokens: those a slot's cache held already (not prefilled again)
    prefix_hits: int  # requests that found a prefix of their prompt in a slot's cache
    tokens_generated: int
    busy_seconds: float  # time spent in steps

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated per second of stepping (all slots together)."""
        return self.tokens_generated / self.busy_seconds if self.busy_seconds > 0 else 0.0


@dataclass
class _Counters:
    submitted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prefix_hits: int = 0
    tokens_generated: int = 0
    busy_seconds: float = 0.0


class Scheduler:
    def __init__(self, engine, *, parallel: int | None = None, queue_size: int = 16, prefill_chunk: int | None = None):
        """`prefill_chunk`: the prompt tokens prefilled a step, all prefilling requests together (default:
        PREFILL_CHUNK, or the engine's `prefill_chunk` where that is smaller)."""
        parallel = engine.slots if parallel is None else parallel
        if not 1 <= parallel <= engine.slots:
            raise ValueError(f"parallel must be in [1, {engine.slots}] (the engine's slots); got {parallel}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be non-negative; got {queue_size}")
        prefill_chunk = min(PREFILL_CHUNK, engine.prefill_chunk) if prefill_chunk is None else prefill_chunk
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer; got {prefill_chunk!r}")
        self.engine, self.parallel, self.queue_size = engine, parallel, queue_size
        self.prefill_chunk = prefill_chunk
        self._free = list(range(parallel))  # least recently used first
        self._waiting: deque[Job] = deque()
        self._running: dict[int, _Running] = {}
        self._counters = _Counters()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="picompile-scheduler", daemon=True)

    # ---------------------------------------------------------------- the submitters' side

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; it is admitted into a slot at the next step one is free."""
        with self._changed:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if len(self._waiting) >= self.queue_size + len(self._free):  # free slots take jobs at the next step
                raise QueueFull(f"all {self.parallel} slots are busy and {self.queue_size} requests are waiting")
            self._waiting.append(job)
            self._counters.submitted += 1
            self._changed.notify()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, cancel the waiting and running ones (each gets its FinishEvent) and stop the thread."""
        with self._changed:
            self._closed = True
            for job in [*self._waiting, *(running.job for running in self._running.values())]:
                job.cancel()
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stepping(self) -> bool:
        """Whether the scheduler's thread runs (started, not closed, not died): a replica's health check."""
        return self._thread.is_alive() and not self._closed

    def stats(self) -> SchedulerStats:
        with self._changed:
            counters = self._counters
            return SchedulerStats(self.parallel, len(self._running), len(self._waiting), self.queue_size,
                                  counters.submitted, dict(counters.finished), counters.prompt_tokens,
                                  counters.prompt_tokens_cached, counters.prefix_hits, counters.tokens_generated,
                                  counters.busy_seconds)

    # ---------------------------------------------------------------- the scheduler's thread

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not (self._closed or self._waiting or self._running):
                    self._changed.wait()
                if self._closed and not self._running and not self._waiting:
                    return
                # jobs still waiting whose clients left (or that close() cancelled) leave the queue now
                gone = [job for job in self._waiting if job.cancelled]
                for job in gone:
                    self._waiting.remove(job)
                while self._waiting and self._free:
                    job = self._waiting.popleft()
                    slot = self._slot_for(job)
                    self._free.remove(slot)
                    rng = np.random.default_rng(job.sampling.seed) if job.sampling.temperature > 0 else None
                    self._running[slot] = _Running(job, rng)
                step = list(self._running.items())
            for job in gone:
                self._count_finish("cancelled")
                self._emit(job, FinishEvent("cancelled", len(job.prompt_ids), 0))
            began = time.perf_counter()
            live = []
            for slot, running in step:
                if running.job.cancelled:
                    self._finish(slot, "cancelled")
                else:
                    live.append((slot, running))
            decoding = [(slot, running) for slot, running in live if running.last_token is not None]
            if decoding:
                self._decode(decoding)
            budget = self.prefill_chunk
            for slot, running in live:
                if running.last_token is None and budget > 0:
                    budget -= self._prefill(slot, running, budget)
            with self._changed:
                self._counters.busy_seconds += time.perf_counter() - began

    def _slot_for(self, job: Job) -> int:
        """The free slot whose cache holds the longest prefix of the job's prompt; of equals (none holding any),
        the least recently used (the front of `_free`)."""
        held = [self.engine.prefix_length(job.prompt_ids, slot) for slot in self._free]
        return self._free[int(np.argmax(held))]  # (argmax: the first of the longest)

    def _prefill(self, slot: int, running: _Running, budget: int) -> int:
        """The next part of a newly admitted request's prefill, at most `budget` tokens of what the slot's cache
        does not hold; after its last part, its first token. Returns the tokens prefilled."""
        job = running.job
        try:
            if running.prefilled is None:
                running.prefilled = cached = start_prompt(self.engine, job.prompt_ids, slot, reuse=job.cache_prompt)
                with self._changed:
                    self._counters.prompt_tokens += len(job.prompt_ids)
                    self._counters.prompt_tokens_cached += cached
                    self._counters.prefix_hits += cached > 0
            start, stop = running.prefilled, min(len(job.prompt_ids), running.prefilled + budget)
            logits = prefill_part(self.engine, job.prompt_ids, slot, start, stop)
        except Exception as error:  # this request fails; the others go on
            self._failed(slot, error)
            return 0
        running.prefilled = stop
        if stop == len(job.prompt_ids):
            self._sampled(slot, running, logits)
        return stop - start

    def _decode(self, step: list[tuple[int, _Running]]) -> None:
        """One decode step of every request past its prefill, as one batch; if the batch is refused before it
        ran (a ValueError: a request's context is full, say), each request's own decode step, so that only the
        failing ones fail; if it failed running, all of them."""
        slots = [slot for slot, _ in step]
        try:
            logits = self.engine.forward_batch([running.last_token for _, running in step], slots)
        except Exception as error:
            if not isinstance(error, ValueError):
                for slot, _ in step:
                    self._failed(slot, error)
                return
            for slot, running in step:
                try:
                    row = self.engine.forward([running.last_token], slot)[-1]
                except Exception as error:
                    self._failed(slot, error)
                else:
                    self._sampled(slot, running, row)
            return
        for (slot, running), row in zip(step, logits):
            self._sampled(slot, running, row)

    def _sampled(self, slot: int, running: _Running, logits: np.ndarray) -> None:
        """A request's next token from its logits, then its event (or its end)."""
        job, sampling = running.job, running.job.sampling
        try:
            token = sample(logits, running.rng, sampling.temperature, sampling.top_k, sampling.top_p)
        except Exception as error:  # this request fails; the others go on
            return self._failed(slot, error)
        running.generated += 1
        running.last_token = token
        with self._changed:
            self._counters.tokens_generated += 1
        if token in sampling.stop_ids:
            return self._finish(slot, "stop")
        self._emit(job, TokenEvent(token))
        if running.generated >= sampling.max_tokens:
            self._finish(slot, "length")

    def _failed(self, slot: int, error: Exception) -> None:
        self._finish(slot, "error", f"{type(error).__name__}: {error}", isinstance(error, EngineUnavailable))

    def _finish(self, slot: int, reason: str, error: str | None = None, unavailable: bool = False) -> None:
        with self._changed:
            running = self._running.pop(slot)
            self._free.append(slot)
        self._count_finish(reason)
        self._emit(running.job, FinishEvent(reason, len(running.job.prompt_ids), running.generated, error,
                                            unavailable))

    def _count_finish(self, reason: str) -> None:
        with self._changed:
            self._counters.finished[reason] += 1

    @staticmethod
    def _emit(job: Job, event: TokenEvent | FinishEvent) -> None:
        try:
            job.on_event(event)
        except Exception:  # a submitter whose callback fails has gone: stop generating for it
            job.cancel()
