"""The target's replies made by OpenAI-compatible servers: `data regenerate --server URL ...`.

    specheads data regenerate --server http://gpu0:8000 --server http://gpu1:8000 --input FILE --output FILE
        [--target SERVED_NAME] [--server-concurrency 8] [--retry-minutes 10] [--temperature T --top-p P
        --top-k K --seed S] [--max-new-tokens N] [--thinking default|on|off] [--api-key KEY]

A target too large for one device is served by the engine its users already run (vLLM,
SGLang with tensor parallelism, or `specheads serve`); this module asks those servers for
the replies that data/regenerate.py otherwise decodes locally. Nothing is loaded here: each
reply is one POST /v1/chat/completions carrying the conversation so far as chat messages, so
the server applies its own chat template (`--thinking on|off` travels as
`chat_template_kwargs: {"enable_thinking": ...}`, which vLLM and SGLang pass to the
template), with `max_tokens` = --max-new-tokens and every sampling field set explicitly:
temperature, top_p, top_k and the seed as given (greedy by default), min_p and the three
penalties at their neutral values (openai_wire.NEUTRAL_SAMPLING). A field left out would be
filled from the model's generation_config.json, as vLLM and SGLang do by default, and the
replies would not be the target's own. Which turns are asked, in which order, and what an empty reply does are
data/regenerate.py's RecordJob's rules, the same as the local path's; so are the output
lines, the in-order writing and the resume file (a run may resume a local one of the same
settings, and the other way round).

A reply's reasoning is kept as the server returns it: `reasoning_content` (SGLang, DeepSeek,
vLLM before 0.11) or `reasoning` (vLLM since), written as `reasoning_content`; a server
without a reasoning parser returns `<think>...</think>` in the content, which is split off as
the local path does. An earlier reply's reasoning is sent back under both names.

Spreading and failures: every URL gets --server-concurrency workers that take the next
request from one queue, lowest record first (so records finish nearly in input order and few
wait in memory for an earlier one; at most WINDOW_PER_WORKER x workers records are started
ahead of the last one written). A failed request (no connection, a timeout, HTTP 408, 429 or
5xx, a malformed answer) is retried on whichever server takes it next, after a backoff of
BACKOFF_S x 2^(attempt - 1) seconds (at most MAX_BACKOFF_S) with jitter (half of it drawn at
random, so requests that failed together do not return together; longer if the server said
Retry-After), for as long as --retry-minutes allows from its first failure (10 by default:
a server restart, even of the only server, loses nothing). A server whose requests fail
OUT_AFTER_FAILURES times in a row is taken out: its workers wait, and GET /v1/models probes it
with a growing pause until it answers (while every server is out, all keep being tried). A
record whose request still fails is reported by index and no record from it on is started or
written: the next run resumes there.

A record whose request the server refuses (any other 4xx: a prompt longer than its context, a
chat-template error) is skipped, counted under its reason and written to OUTPUT.rejects.jsonl
with the server's message (data/regenerate.py), and the run goes on. Two refusals stop the
run instead, as mistakes in the command that every record would repeat: 401/403 (the API
key) and 404 (the model name), and so does a run whose first REFUSED_BEFORE_ANY_REPLY
records are all refused before any reply came (a parameter the server does not take).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from specheads.data.chat import THINKING_MODES, THINKING_SWITCH
from specheads.data.openai_wire import (CHAT_PATH, CONNECT_TIMEOUT_S, MODELS_PATH, NEUTRAL_SAMPLING, error_text,
                                         reply_of, retry_after, served_model, server_url, too_long, wire_message)
from specheads.data.regenerate import RecordJob, ReplyMeter
from specheads.data.reply_progress import WRITE_EVERY, InOrderWriter, Progress, rejects_path, start_progress
from specheads.data.text import DataError, load_records

DEFAULT_CONCURRENCY = 8  # requests in flight per server
DEFAULT_RETRY_MINUTES = 10.0  # how long a failed request keeps being retried
BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
OUT_AFTER_FAILURES = 3  # failed requests in a row that take a server out
PROBE_S, MAX_PROBE_S = 2.0, 60.0  # the pause before probing a server that is out, doubled per failed probe
WINDOW_PER_WORKER = 4  # records started beyond the last one written, per worker (plus one write's worth)
RETRYABLE_STATUS = {408, 429}  # and every 5xx
COMMAND_MISTAKES = {401: "the API key", 403: "the API key", 404: "the model name"}  # 4xx that stop the run
REFUSED_BEFORE_ANY_REPLY = 8  # refused records, with no reply yet, that stop the run


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters sent with every request (`specheads generate`'s names and
    meanings: temperature 0 is greedy, top_k 0 keeps every token). With a seed, request
    (record, turn) gets its own seed drawn from it, so a rerun or resume draws the same."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DataError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DataError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DataError(f"--top-k must be >= 0 (0: every token), got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise DataError(f"--seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_progress(self) -> dict:
        """What the resume file records: {} when greedy (the local path's replies are greedy)."""
        return {} if self.greedy else {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                       "seed": self.seed}

    def request_fields(self, record: int, turn: int) -> dict:
        """Every sampling field of one request, explicitly (module doc): what is not sampling's
        own is neutral, so that no server fills it from the model's generation_config.json."""
        fields = dict(NEUTRAL_SAMPLING, temperature=self.temperature)
        if self.greedy:
            return fields
        fields["top_p"] = self.top_p
        if self.top_k:  # 0 (every token) stays NEUTRAL_SAMPLING's -1
            fields["top_k"] = self.top_k
        if self.seed is not None:
            fields["seed"] = random.Random(f"{self.seed}:{record}:{turn}").getrandbits(31)
        return fields


def backoff_delay(attempt: int, backoff_s: float, rng: random.Random, retry_after: float | None = None) -> float:
    """The pause before a failed request's next attempt (attempt >= 1): backoff_s x 2^(attempt - 1),
    at most MAX_BACKOFF_S, of which a random half is taken off (jitter), or the server's
    Retry-After if that is longer (also at most MAX_BACKOFF_S)."""
    delay = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
    delay = delay / 2 + rng.uniform(0, delay / 2)
    return delay if retry_after is None else max(delay, min(retry_after, MAX_BACKOFF_S))


@dataclass
class ServerCounts:
    url: str
    num_ok: int = 0
    num_errors: int = 0
    num_taken_out: int = 0


@dataclass
class RequestCounts:
    """What the servers did in one run (not kept across resumes)."""

    servers: list[ServerCounts]
    num_retried: int = 0  # requests sent again after a failure
    num_refused: int = 0  # records a server refused (4xx): in the rejects file
    failed_records: list[int] = field(default_factory=list)  # records whose request failed every attempt
    last_errors: dict[int, str] = field(default_factory=dict)  # failed record -> "URL: its last error"
    num_unwritten: int = 0  # records finished after a failed one, made again by the next run

    def summary(self) -> str:
        num_ok = sum(s.num_ok for s in self.servers)
        per_server = "; ".join(f"{s.url}: {s.num_ok} ok, {s.num_errors} errors"
                               + (f", taken out {s.num_taken_out}x" if s.num_taken_out else "") for s in self.servers)
        text = (f"server requests: {num_ok} ok, {self.num_retried} retried ({per_server}); "
                f"records refused: {self.num_refused}; records failed: ")
        if not self.failed_records:
            return text + "0"
        first = min(self.failed_records)
        records = ", ".join(str(i) for i in sorted(self.failed_records)[:10])
        return (text + f"{len(self.failed_records)} ({records}{', ...' if len(self.failed_records) > 10 else ''}; "
                f"record {first}'s last error: {self.last_errors[first]}): a rerun resumes at record {first}")


@dataclass
class ServerRun:
    progress: Progress
    requests: RequestCounts
    rejects: Path | None = None  # the rejects file, when it holds any record

    def summary(self) -> str:
        text = f"{self.progress.summary()}; {self.requests.summary()}"
        return text + (f"; refused records and why: {self.rejects}" if self.rejects is not None else "")


@dataclass(order=True)
class _Request:
    record: int
    turn: int
    messages: list = field(compare=False)
    attempt: int = field(default=0, compare=False)
    first_failure: float | None = field(default=None, compare=False)  # time.monotonic() of its first failure


class _Server:
    def __init__(self, url: str):
        self.url = url
        self.counts = ServerCounts(url)
        self.failures_in_a_row = 0
        self.out = False


class _ServerReplies:
    """One run: the workers of every server over one request queue, the records in flight,
    and the writer that puts finished records into the output in input order."""

    def __init__(self, servers: list[_Server], records: list, start: int, stop: int, writer: InOrderWriter,
                 meter: ReplyMeter, base_body: dict, sampling: Sampling, concurrency: int, retry_s: float,
                 backoff_s: float):
        self.servers, self.records, self.next_record, self.stop = servers, records, start, stop
        self.writer, self.meter, self.base_body, self.sampling = writer, meter, base_body, sampling
        self.concurrency, self.retry_s, self.backoff_s = concurrency, retry_s, backoff_s
        self.jitter = random.Random()
        self.window = writer.every + WINDOW_PER_WORKER * concurrency * len(servers)
        self.counts = RequestCounts([server.counts for server in servers])
        self.active: dict[int, RecordJob] = {}  # started records that are not done
        self.first_failed: int | None = None
        self.fatal: str | None = None

    async def run(self, client) -> None:
        self.client = client
        self.queue: asyncio.PriorityQueue[_Request] = asyncio.PriorityQueue()
        self.finished, self.changed = asyncio.Event(), asyncio.Event()
        self.probes: set[asyncio.Task] = set()
        for server in self.servers:
            if server.out:
                self._take_out(server, counted=False)
        self._feed()
        workers = [asyncio.create_task(self._worker(server)) for server in self.servers
                   for _ in range(self.concurrency)]
        try:
            await self.finished.wait()
        finally:
            for task in workers + list(self.probes):
                task.cancel()
            await asyncio.gather(*workers, *self.probes, return_exceptions=True)

    def _feed(self) -> None:
        """Start records in input order while the window allows; set `finished` when none is left."""
        while (self.first_failed is None and self.next_record < self.stop
               and self.next_record - self.writer.progress.next_record < self.window):
            job = RecordJob(self.next_record, self.records[self.next_record], list)
            self.next_record += 1
            if job.done:  # skipped before any reply
                self.writer.finished(job)
                continue
            self.active[job.index] = job
            for turn, messages in job.first_prompts:
                self.queue.put_nowait(_Request(job.index, turn, messages))
        if not self.active and (self.first_failed is not None or self.next_record >= self.stop or self.fatal):
            self.finished.set()

    async def _worker(self, server: _Server) -> None:
        while True:
            while server.out and not all(s.out for s in self.servers):
                await self.changed.wait()
            request = await self.queue.get()
            if request.record not in self.active:  # its record was given up
                continue
            if server.out and not all(s.out for s in self.servers):  # taken out while this worker waited
                self.queue.put_nowait(request)
                continue
            await self._send(server, request)

    async def _send(self, server: _Server, request: _Request) -> None:
        import httpx

        body = dict(self.base_body, messages=[wire_message(m) for m in request.messages],
                    **self.sampling.request_fields(request.record, request.turn))
        try:
            response = await self.client.post(server.url + CHAT_PATH, json=body)
        except httpx.RequestError as err:
            return self._failed(server, request, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
        status = response.status_code
        if status == 200:
            try:
                message, num_tokens = reply_of(response.json())
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                return self._failed(server, request, f"a malformed answer ({type(err).__name__}: {err})")
            server.counts.num_ok += 1
            server.failures_in_a_row = 0
            return self._replied(request, message, num_tokens)
        text = error_text(response)
        if status >= 500 or status in RETRYABLE_STATUS:
            return self._failed(server, request, f"HTTP {status}: {text}", server_fault=status != 429,
                                retry_after=retry_after(response))
        server.failures_in_a_row = 0  # it answered
        refusal = f"server {server.url} refused record {request.record}'s request (HTTP {status}): {text}"
        if status in COMMAND_MISTAKES:
            return self._stop(f"{refusal}; check {COMMAND_MISTAKES[status]}")
        self.counts.num_refused += 1
        if not any(s.counts.num_ok for s in self.servers) and self.counts.num_refused >= REFUSED_BEFORE_ANY_REPLY:
            return self._stop(f"{refusal}; the first {self.counts.num_refused} records were all refused and none "
                              "answered, so the command is likely at fault (a parameter the server does not take?)")
        reason = "longer than the server's context" if too_long(status, text) else f"refused by the server (HTTP {status})"
        self._refused(request, reason, {"turn": request.turn, "status": status, "reason": text})

    def _stop(self, message: str) -> None:
        self.fatal = message
        self.finished.set()

    def _replied(self, request: _Request, message: dict, num_tokens: int) -> None:
        job = self.active.get(request.record)
        if job is None:  # given up meanwhile
            return
        self.meter.reply(num_tokens)
        follow_up = job.took_reply(request.turn, message)
        if follow_up is not None:
            self.queue.put_nowait(_Request(job.index, *follow_up))
        elif job.done:
            self._done(job)

    def _refused(self, request: _Request, reason: str, rejection: dict) -> None:
        job = self.active.get(request.record)
        if job is not None:
            job.refuse(reason, rejection)
            self._done(job)

    def _done(self, job: RecordJob) -> None:
        del self.active[job.index]
        self.writer.finished(job)
        self._feed()

    def _failed(self, server: _Server, request: _Request, reason: str, server_fault: bool = True,
                retry_after: float | None = None) -> None:
        server.counts.num_errors += 1
        if server_fault:
            server.failures_in_a_row += 1
            if server.failures_in_a_row >= OUT_AFTER_FAILURES and not server.out:
                self._take_out(server)
        if request.record not in self.active:  # given up meanwhile
            return
        request.attempt += 1
        now = time.monotonic()
        request.first_failure = now if request.first_failure is None else request.first_failure
        left = request.first_failure + self.retry_s - now
        if left <= 0:
            self.counts.last_errors[request.record] = f"{server.url}: {reason}"
            return self._give_up(request.record)
        self.counts.num_retried += 1
        delay = backoff_delay(request.attempt, self.backoff_s, self.jitter, retry_after)
        asyncio.get_running_loop().call_later(min(delay, left), self.queue.put_nowait, request)

    def _give_up(self, record: int) -> None:
        """A record that failed every attempt: it and every record after it are left for the next run."""
        self.counts.failed_records.append(record)
        self.first_failed = record if self.first_failed is None else min(self.first_failed, record)
        for index in [index for index in self.active if index >= self.first_failed]:
            del self.active[index]
        self._feed()

    def _take_out(self, server: _Server, counted: bool = True) -> None:
        server.out = True
        server.counts.num_taken_out += counted
        self._notify()
        probe = asyncio.create_task(self._probe(server))
        self.probes.add(probe)
        probe.add_done_callback(self.probes.discard)

    async def _probe(self, server: _Server) -> None:
        """Bring a server back once GET /v1/models answers, probing with a doubling pause."""
        import httpx

        pause = PROBE_S
        while True:
            await asyncio.sleep(pause)
            try:
                response = await self.client.get(server.url + MODELS_PATH, timeout=CONNECT_TIMEOUT_S)
                if response.status_code == 200:
                    break
            except httpx.RequestError:
                pass
            pause = min(2 * pause, MAX_PROBE_S)
        server.out, server.failures_in_a_row = False, 0
        self._notify()

    def _notify(self) -> None:
        """Wake the workers waiting for a server to come back (or for every server to be out)."""
        self.changed.set()
        self.changed = asyncio.Event()


def regenerate_with_servers(urls: list[str], input_path: str, output_path: str, *, model: str | None = None,
                            max_new_tokens: int = 256, batch_size: int = 96, max_batches: int | None = None,
                            thinking: str = "default", sampling: Sampling = Sampling(),
                            concurrency: int = DEFAULT_CONCURRENCY, retry_minutes: float = DEFAULT_RETRY_MINUTES,
                            backoff_s: float = BACKOFF_S, request_timeout_s: float = 600.0,
                            api_key: str | None = None, log=print, progress_bar: bool = True) -> ServerRun:
    """Regenerate `input_path` into `output_path` with the replies of the servers at `urls`,
    resuming a previous run (data/regenerate.py's format and resume file); -> the progress
    and the request counts. model: the served model name (None: the one the servers serve).
    Records are written min(batch_size, WRITE_EVERY) at a time; max_batches stops after that
    many batch_size records (a later call continues). A record whose request kept failing for
    retry_minutes ends the run early (module doc): see the result's requests.failed_records."""
    import httpx

    if max_new_tokens < 1 or batch_size < 1 or concurrency < 1 or not retry_minutes >= 0 or request_timeout_s <= 0:
        raise DataError(f"max new tokens, batch size and server concurrency must be >= 1, retry minutes >= 0 and the "
                        f"request timeout > 0; got {max_new_tokens}, {batch_size}, {concurrency}, {retry_minutes}, "
                        f"{request_timeout_s}")
    if thinking not in THINKING_MODES:
        raise DataError(f"thinking: expected one of {', '.join(THINKING_MODES)}, got {thinking!r}")
    bases = [server_url(url) for url in urls]
    if not bases or len(set(bases)) != len(bases):
        raise DataError(f"--server: give each server once, at least one; got {', '.join(urls) or 'none'}")
    records = load_records(input_path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model, target, down = served_model(bases, model, headers)
    for url in down:
        log(f"regenerate: server {url} does not answer; it is probed and used once it does")
    output = Path(output_path)
    progress = start_progress(input_path, output, len(records), max_new_tokens, thinking, sampling.as_progress(),
                              target=target, served_model=model)
    servers = [_Server(url) for url in bases]
    for server in servers:
        server.out = server.url in down
    if progress.next_record >= len(records):
        log(f"regenerate: {output} is complete: {progress.summary()}")
        return ServerRun(progress, RequestCounts([server.counts for server in servers]))
    if progress.next_record:
        log(f"regenerate: resuming at record {progress.next_record}")
    stop = len(records) if max_batches is None else min(len(records), progress.next_record + max_batches * batch_size)
    base_body = {"model": model, "max_tokens": max_new_tokens, "stream": False}
    if thinking != "default":
        base_body["chat_template_kwargs"] = {THINKING_SWITCH: thinking == "on"}
    to_come = sum(RecordJob(index, records[index], list).max_replies for index in range(progress.next_record, stop))
    meter = ReplyMeter(progress.num_turns + to_come, f"regenerate: {model}'s replies", progress_bar,
                       initial=progress.num_turns)
    writer = InOrderWriter(output, progress, min(batch_size, WRITE_EVERY))
    run = _ServerReplies(servers, records, progress.next_record, stop, writer, meter, base_body, sampling,
                         concurrency, 60.0 * retry_minutes, backoff_s)
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=len(servers) * (concurrency + 1))
    started = time.perf_counter()

    async def main():
        async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
            await run.run(client)

    try:
        asyncio.run(main())
    finally:
        run.counts.num_unwritten = writer.flush()
        meter.close()
    if run.fatal:
        raise DataError(run.fatal)
    if run.counts.num_unwritten and not run.counts.failed_records:
        raise RuntimeError(f"regenerate: {run.counts.num_unwritten} records finished behind record "
                           f"{progress.next_record}, which never did; nothing after it was written")
    result = ServerRun(progress, run.counts, rejects_path(output) if progress.rejects_bytes else None)
    log(f"regenerate: {result.summary()} in {time.perf_counter() - started:.0f}s")
    return result
