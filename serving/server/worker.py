"""The server's engine worker: one thread owns a `Scheduler` and feeds it from a queue.

The event loop submits `Job`s (one HTTP request: one or more sequences, the choices).
The worker admits queued sequences while the batch has room, calls `step()` in a loop,
detokenizes each sequence's new tokens (string stop sequences end a sequence early) and
posts per-choice events to the job's asyncio queue with `loop.call_soon_threadsafe`. A job
cancelled by the event loop (client gone) or past its deadline has its sequences dropped
before the next step. Admission is capped: with `max_queue` jobs already waiting,
`submit` refuses at once (the app answers 503 with Retry-After) instead of letting clients
time out.

Faults (serving/decode/faults.py says which errors are fatal). An error that ends one sequence (its
prefill, a step of it, detokenizing its tokens) fails that sequence's job alone with a 500
`sequence_failed` error; its other choices are dropped and every other job goes on. Only a
fatal error (the device lost, out of memory again after a retry) ends the worker: every job
gets an error and the server reports unhealthy until it is restarted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from specheads.serving.decode.faults import describe, is_fatal
from specheads.serving.decode.scheduler import Scheduler, SequenceRequest
from specheads.serving.decode.stats import DecodeStats
from specheads.serving.server.detokenize import IncrementalDetokenizer
from specheads.serving.server.logprobs import ScoredToken, TokenText
from specheads.serving.server.metrics import ServerMetrics

log = logging.getLogger("specheads.serve")
IDLE_WAIT_S = 0.05  # how often an idle worker rechecks deadlines and shutdown


def speculation_stats(stats: DecodeStats, enabled: bool) -> dict:
    """One choice's speculation stats, as a response reports them (`drafts`: speculative verify steps)."""
    return {"enabled": enabled, "steps": stats.steps, "drafts": stats.speculative_steps,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "accepted_per_position": list(stats.accepted_per_position), "alpha": stats.alpha, "tau": stats.tau,
            "fallback": stats.fallback, "lookup_accepted_tokens": stats.lookup_accepted,
            "store_accepted_tokens": stats.store_accepted}


class QueueFull(Exception):
    """The admission queue is full: the request is refused, to be retried later."""


class EngineUnavailable(Exception):
    """The engine is stopping or has failed; no new work is accepted."""


@dataclass
class Choice:
    """One sequence of a job: the engine request plus what turns its tokens into text."""
    index: int
    request: SequenceRequest
    stop: list[str] = field(default_factory=list)
    echo: str | None = None  # the prompt's text, to come before the completion's (completions' `echo`)


@dataclass
class Event:
    """Worker -> event loop. kind: "delta" | "finish" | "error"."""
    kind: str
    index: int = 0
    text: str = ""
    num_tokens: int = 0  # delta: new tokens; finish: the choice's completion tokens
    finish_reason: str | None = None
    stats: dict | None = None  # finish: speculation stats of the choice
    status: int = 500  # error: HTTP status
    message: str = ""
    code: str | None = None
    logprobs: list[ScoredToken] | None = None  # delta/finish: the scores of the tokens since the last event


class Job:
    """One request's sequences and the queue its events arrive on (see the module doc)."""

    def __init__(self, choices: list[Choice], loop: asyncio.AbstractEventLoop, timeout_s: float | None):
        self.choices = choices
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.deadline = None if timeout_s is None else self.arrival + timeout_s
        self.cancel_reason: str | None = None  # set by the event loop, read by the worker
        self.done = False  # every choice finished or the job failed (worker side)
        self.next_choice = 0  # worker side: choices admitted so far
        self.pending = len(choices)

    def cancel(self, reason: str) -> None:
        """Ask the worker to drop this job's sequences (idempotent, any thread; a no-op once the
        job is done, so that its sequences are counted under the reason it ended for)."""
        if self.cancel_reason is None and not self.done:
            self.cancel_reason = reason

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _Running:
    """Worker-side state of one admitted sequence."""

    def __init__(self, job: Job, choice: Choice, detok: IncrementalDetokenizer, speculative: bool):
        self.job = job
        self.choice = choice
        self.detok = detok
        self.speculative = speculative  # drafts (heads or n-gram lookup); False: plain decoding
        self.num_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.text = choice.echo or ""  # text not yet posted (an echoed prompt goes first)
        # logprobs asked: the scores not yet posted (an echoed prompt's first); None: not asked
        self.scores: list[ScoredToken] | None = None if choice.request.logprobs is None else []
        self.num_prompt_scores = 0  # how many of `scores` are the prompt's (never counted as tokens)
        self.num_scores_posted = 0  # generated tokens' scores posted so far

    def take(self, text: str, num_tokens: int | None = None) -> tuple[str, list[ScoredToken] | None]:
        """-> the text and scores to post now; num_tokens: the sequence's final token count
        (a stop string may end it before tokens already scored)."""
        text, self.text = self.text + text, ""
        scores = self.scores
        if scores is None:
            return text, None
        if num_tokens is not None:
            scores = scores[:self.num_prompt_scores + max(0, num_tokens - self.num_scores_posted)]
        self.num_scores_posted += len(scores) - self.num_prompt_scores
        self.scores, self.num_prompt_scores = [], 0
        return text, scores


class Engine:
    """The worker thread (see the module docstring). Thread-safe `submit` and `stop`."""

    def __init__(self, decoder, tokenizer, metrics: ServerMetrics, max_concurrency: int = 8,
                 max_queue: int = 64):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_queue = max_queue
        self.session = Scheduler(decoder, max_batch_size=max_concurrency)
        self.token_text = TokenText(tokenizer)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, _Running] = {}
        self._admitting: Job | None = None  # the job whose sequence add() is admitting (a failure there is fatal)
        self._stopping = False
        self.fatal_error: str | None = None
        self._thread = threading.Thread(target=self._main, name="specheads-engine", daemon=True)
        metrics.running.set_function(lambda: len(self._running))
        metrics.waiting.set_function(lambda: len(self._waiting))
        learned = decoder.store.learned if decoder.store is not None else None
        if learned is not None:
            metrics.learned_tokens.set_function(lambda: learned.num_tokens)
            metrics.learned_replies.set_function(lambda: learned.num_replies)

    # ----- event-loop side -----
    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.fatal_error is None and self._thread.is_alive() and not self._stopping

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull / EngineUnavailable without queueing it."""
        with self._cond:
            if self.fatal_error is not None:
                raise EngineUnavailable(f"the engine failed: {self.fatal_error}")
            if self._stopping:
                raise EngineUnavailable("the server is shutting down")
            free_slots = max(0, self.session.max_batch_size - len(self._running))
            if len(self._waiting) >= self.max_queue + free_slots:
                raise QueueFull(f"the admission queue is full ({self.max_queue} requests waiting)")
            self._waiting.append(job)
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new jobs, fail the remaining ones, end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ----- worker side -----
    def _main(self) -> None:
        try:
            self._loop()
        except Exception as err:  # noqa: BLE001 - any engine failure is fatal and reported
            log.exception("engine worker failed")
            self.fatal_error = f"{type(err).__name__}: {err}"
            self._fail_all(500, f"the engine failed: {self.fatal_error}", "engine_error")

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
                if not self._running and not self._waiting:
                    self._cond.wait(IDLE_WAIT_S)
                    continue
            self._reap()
            self._admit()
            if self.session.num_active:
                updates = self.session.step()
                now = time.monotonic()
                for update in updates:
                    try:
                        self._on_update(update, now)
                    except Exception as err:  # noqa: BLE001 - one sequence's fault fails its job alone
                        if is_fatal(err):
                            raise
                        self._fail_sequence(update.seq_id, describe(err))
        self._fail_all(503, "the server shut down before this request finished", "shutting_down")

    def _fail_all(self, status: int, message: str, code: str) -> None:
        with self._cond:
            jobs = list(self._waiting)
            self._waiting.clear()
        jobs += [running.job for running in self._running.values()]
        if self._admitting is not None:
            jobs.append(self._admitting)
        for seq_id in list(self._running):
            self.session.cancel(seq_id)
            self.metrics.aborted.labels(reason=code).inc()
        self._running.clear()
        for job in jobs:
            if job.next_choice == 0:  # never admitted: counted once, as a job
                self.metrics.aborted.labels(reason=code).inc()
            self._fail(job, status, message, code)

    def _fail_sequence(self, seq_id: int, error: str) -> None:
        """A running sequence failed alone: drop it and fail its job."""
        running = self._running.pop(seq_id, None)
        self.session.cancel(seq_id)
        if running is not None:
            self._fail_alone(running.job, error)

    def _fail_alone(self, job: Job, error: str) -> None:
        """One of job's sequences failed (not fatally): a 500 for the job alone; its other
        choices are reaped before the next step."""
        log.error("a sequence failed: %s", error)
        self.metrics.aborted.labels(reason="error").inc()
        self._fail(job, 500, f"generating this request failed: {error}", "sequence_failed")

    def _fail(self, job: Job, status: int, message: str, code: str | None) -> None:
        if not job.done:
            job.done = True
            job.post(Event("error", status=status, message=message, code=code))

    def _reap(self) -> None:
        """Drop sequences whose job was cancelled or ran past its deadline."""
        now = time.monotonic()
        timed_out = []
        for seq_id, running in list(self._running.items()):
            job = running.job
            expired = job.deadline is not None and now > job.deadline
            if job.cancel_reason is not None or expired or job.done:
                self.session.cancel(seq_id)
                del self._running[seq_id]
                reason = job.cancel_reason or ("timeout" if expired else "failed")
                self.metrics.aborted.labels(reason=reason).inc()
                if expired and job.cancel_reason is None:
                    timed_out.append(job)
        with self._cond:
            for job in list(self._waiting):
                expired = job.deadline is not None and now > job.deadline
                if job.cancel_reason is not None or expired:
                    self._waiting.remove(job)
                    self.metrics.aborted.labels(reason=job.cancel_reason or "timeout").inc()
                    if expired and job.cancel_reason is None:
                        timed_out.append(job)
        for job in timed_out:
            self._fail(job, 504, "the request did not finish within the server's request timeout", "timeout")

    def _admit(self) -> None:
        while self.session.has_capacity:
            with self._cond:
                if not self._waiting:
                    return
                job = self._waiting[0]
                choice = job.choices[job.next_choice]
                job.next_choice += 1
                if job.next_choice == len(job.choices):
                    self._waiting.popleft()
            if job.done or job.cancel_reason is not None:
                continue
            self._admitting = job
            try:
                detok = IncrementalDetokenizer(self.tokenizer, choice.request.input_ids, choice.stop)
                seq_id = self.session.add(choice.request)
            except Exception as err:  # noqa: BLE001 - refused (ValueError) or failed alone, unless fatal
                if is_fatal(err):
                    raise
                self._admitting = None
                if isinstance(err, ValueError):  # the engine refused this request
                    self.metrics.rejected.labels(status=400).inc()
                    self._fail(job, 400, str(err), "invalid_value")
                else:  # its prefill (SequenceFailed) or its detokenizer failed
                    self._fail_alone(job, describe(err))
                with self._cond:
                    if self._waiting and self._waiting[0] is job:
                        self._waiting.popleft()
                continue
            self._running[seq_id] = _Running(job, choice, detok, choice.request.speculate and self.decoder.speculates)
            self._admitting = None

    def _on_update(self, update, now: float) -> None:
        running = self._running.get(update.seq_id)
        if running is None:
            return
        if update.finished and update.result.error is not None:
            self._fail_sequence(update.seq_id, update.result.error)
            return
        job, choice = running.job, running.choice
        tokens = list(update.new_tokens)
        if running.scores is not None:
            self._score(running, update)
        text = ""
        if tokens:
            if running.first_token_at is None:
                running.first_token_at = now
            else:
                gap = (now - running.last_token_at) / len(tokens)
                for _ in tokens:
                    self.metrics.itl.observe(gap)
            running.last_token_at = now
            running.num_tokens += len(tokens)
            text = running.detok.push(tokens)
        if running.detok.stopped:
            if running.detok.stop_token_index is not None:
                running.num_tokens = running.detok.stop_token_index
            partial = update.result if update.finished else self.session.cancel(update.seq_id)
            stats = partial.stats
            self._finish(update.seq_id, running, text, "stop", stats, now)
            return
        if update.finished:
            text += running.detok.finish()
            result = update.result
            reason = result.finish_reason
            if running.detok.stopped:  # the stop string only settled in the flushed tail
                reason = "stop"
                running.num_tokens = running.detok.stop_token_index or running.num_tokens
            self._finish(update.seq_id, running, text, reason, result.stats, now)
            return
        if text or running.text:
            text, scores = running.take(text)
            job.post(Event("delta", index=choice.index, text=text, num_tokens=len(tokens), logprobs=scores))

    def _score(self, running: _Running, update) -> None:
        """The update's engine scores -> running.scores (an echoed prompt's first)."""
        if update.prompt_logprobs is not None and running.choice.echo is not None:
            prompt = running.choice.request.input_ids
            running.scores += [self.token_text.score(entry, token)
                               for entry, token in zip(update.prompt_logprobs, prompt)]
            running.num_prompt_scores = len(prompt)
        running.scores += [self.token_text.score(entry, entry.token) for entry in update.logprobs]

    def _finish(self, seq_id: int, running: _Running, text: str, reason: str, stats: DecodeStats,
                now: float) -> None:
        del self._running[seq_id]
        job, choice = running.job, running.choice
        speculation = speculation_stats(stats, running.speculative)
        if job.done:
            return
        first = running.first_token_at if running.first_token_at is not None else now
        self.metrics.observe_finished(reason, first - job.arrival, now - job.arrival, len(choice.request.input_ids),
                                      running.num_tokens, speculation["drafts"], speculation["drafted_tokens"],
                                      speculation["accepted_tokens"], speculation["accepted_per_position"],
                                      speculation["lookup_accepted_tokens"], speculation["store_accepted_tokens"])
        text, scores = running.take(text, running.num_tokens)
        job.post(Event("finish", index=choice.index, text=text, num_tokens=running.num_tokens,
                       finish_reason=reason, stats=speculation, logprobs=scores))
        job.pending -= 1
        if job.pending == 0:
            job.done = True
