"""The requests of one generation job: ``concurrency`` workers, each with its own HTTP client
(:mod:`eagledata.generate.transport`), sending one sample at a time with retries, budget
reservations, the response cache, progress and signals.

Faults. 408, 429, 5xx, timeouts (``generation.timeout_s`` per attempt), transport errors, errors
inside 200 bodies, mid-stream errors and unparseable bodies are retried up to ``max_attempts`` with
exponential backoff and jitter; a ``Retry-After`` is a lower bound, and after a 429 every worker
waits it out (the limit is per key). Such an answer is never stored as a success. Other 4xx are
final for that prompt: recorded (status and exact body) in the cache. 401 and 402 stop the job, and
so does an SGLang answer without usable token ids (:data:`~eagledata.generate.answers.IDS_FATAL`).

Budget. Every attempt reserves its worst-case cost in the ledger before it is sent; an answer
settles it at its cost; a request that certainly was not sent settles it at 0; anything else that
may have been billed (a timeout, a reset after sending, a cut stream or malformed 200 without a
cost) stays held as an orphan until reconciled (by generation id when known).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from eagledata.generate.answers import IDS_FATAL, Answer, interpret, retryable_status
from eagledata.generate.budget import BudgetExhausted
from eagledata.generate.cache import SERVED_FIELD, ResponseCache
from eagledata.generate.openrouter import FINAL_STATUSES_FATAL
from eagledata.generate.progress import Log
from eagledata.generate.requests import DatasetWork, WorkItem, uses_native_endpoint
from eagledata.generate.rescue import free_space
from eagledata.generate.retryfinal import retry_command
from eagledata.generate.retries import ClientSettings, RateGate, backoff_delay, retry_after_seconds
from eagledata.generate.transport import AttemptTimeout, Response, TransportError, new_client, send

#: What a failed budget-ledger write raises (SQLite's "database or disk is full" is an sqlite3.Error).
LEDGER_WRITE_ERRORS = (sqlite3.Error, OSError)
#: An SSE event carrying the generation id (read from a stream's first events).
SSE_ID = re.compile(rb'data:\s*\{[^\n]*?"id"\s*:\s*"([^"]+)"')
JSON_ENCODER = json.JSONEncoder(ensure_ascii=False)
#: How often a request claimed by another dataset's job is tried again.
CLAIM_POLL_S = 0.05
#: A job whose first answers are this many final errors alike (one status, one body) stops: a
#: setting rather than its prompts is wrong (a model id the provider does not know, an endpoint no
#: provider serves under the account's data policy), and every other prompt would get that answer too.
ALIKE_FINAL_ERRORS_STOP = 5
#: ... and this many in a row after answers: the only provider a routing allows gone mid-run (404 "no
#: allowed providers"), which would otherwise turn every prompt left into a cached final error.
ALIKE_FINAL_ERRORS_STOP_LATER = 20


def ledger_write_error(path: Path, exc: BaseException) -> str:
    """The stop message for a failed ledger write (path, error, free space)."""
    return f"budget ledger write failed: {path}: {exc} ({free_space(path)})"


@dataclass
class Outcome:
    """What one attempt came to."""

    kind: str  # ok | final | fatal | retry
    problem: str = ""
    retry_after: float | None = None
    line: bytes | None = None  # the cache line (ok, final)
    status: int = 0
    body: str = ""  # a final error's body as received (what makes two errors alike)


class GenerationId:
    """The generation id of one attempt, learnt from the ``X-Generation-Id`` header or a stream's
    first events, and noted on the attempt's reservation at once (so a lost answer can be
    reconciled)."""

    def __init__(self, ledger: Any, ref: str | None, stream: bool):
        self.ledger, self.ref, self.stream = ledger, ref, stream
        self.id: str | None = None
        self.sniff = b""

    def _found(self, gid: str) -> None:
        self.id = gid
        if self.ref is not None:
            self.ledger.note(self.ref, generation_id=gid)

    def on_head(self, status: int, headers: Mapping[str, str]) -> None:
        gid = headers.get("x-generation-id")
        if gid:
            self._found(gid)

    def on_data(self, piece: bytes) -> None:
        if self.id is None and self.stream and len(self.sniff) < 16384:
            self.sniff += piece
            m = SSE_ID.search(self.sniff)
            if m:
                self._found(m.group(1).decode("utf-8", "replace"))


class GenerationJob:
    """One dataset's requests: workers, retries, ledger, cache, progress, signals."""

    def __init__(self, work: DatasetWork, items: list[WorkItem], cs: ClientSettings, cache: ResponseCache,
                 ledger: Any, progress: Any, log: Log, reserve_usd: Mapping[str, float], price: Any):
        self.work, self.items, self.cs, self.cache, self.ledger = work, items, cs, cache, ledger
        self.progress, self.log, self.reserve_usd, self.price = progress, log, reserve_usd, price
        self.native = uses_native_endpoint(work.settings)
        self.stream = bool(work.items and work.items[0].request.get("stream"))
        self.gate = RateGate()
        self.stop_reason: str | None = None  # 401/402/budget: JobStopped
        self.interrupt: str | None = None  # signal / job timeout: Interrupted
        self.signum: int | None = None
        self.halt = asyncio.Event()
        self.failures: dict[str, str] = {}
        self.final_errors: list[dict[str, Any]] = []
        self.finished: set[str] = set()
        self.http_requests = 0
        self.cost = 0.0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.over_reservation = 0
        self.unpriced = 0  # successes without a cost or token counts (held until reconciled)
        self.run_s = 0.0
        self.run_cpu_s = 0.0
        self.tasks: list[asyncio.Task] = []
        self.headers = {**cs.headers, "Content-Type": "application/json"}
        self.claims: Any = None  # RequestClaims (eagledata.generate.carryover) of a dedup dataset
        self.served_model: str | None = None  # SGLang: the model path the server reports, in each answer
        self.answers_ok = 0
        self.alike_finals: tuple[tuple[int | None, str], int] = ((None, ""), 0)  # the last answers' final error, how many

    # -- control --------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """No new request or retry starts (:class:`~eagledata.generate.errors.JobStopped` at the end)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.log(f"stopping: {reason}; no new request starts, requests in flight finish")
        self.halt.set()

    def interrupt_now(self, reason: str, signum: int | None = None) -> None:
        """Drain (the first time; at most ``drain_timeout_s``), cancel the requests in flight (again)."""
        if self.interrupt is not None:
            self.log(f"{reason} again: cancelling the requests in flight")
            self.cancel_all()
            return
        self.interrupt, self.signum = reason, signum
        self.halt.set()
        in_flight = self.progress.in_flight
        self.log(f"{reason}: draining {in_flight} request(s) in flight (at most {self.cs.drain_timeout_s:g} s; "
                 f"send the signal again to cancel them), no new request or retry starts")
        asyncio.get_running_loop().call_later(self.cs.drain_timeout_s, self.cancel_all)

    def cancel_all(self) -> None:
        for t in self.tasks:
            t.cancel()

    @property
    def halted(self) -> bool:
        return self.halt.is_set()

    # -- workers --------------------------------------------------------------------------------
    def _signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        """SIGINT/SIGTERM drain the job (main thread only); returns the signals handled."""
        handlers = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self.interrupt_now, f"received {signal.Signals(sig).name}", sig)
                    handlers.append(sig)
                except (NotImplementedError, RuntimeError):
                    pass
        return handlers

    async def run(self) -> None:
        """Every item, by ``concurrency`` workers, until done, stopped or interrupted; an
        unexpected worker exception is re-raised."""
        loop = asyncio.get_running_loop()
        handlers = self._signal_handlers(loop)
        timer = None
        if self.cs.job_timeout_s is not None:
            timer = loop.call_later(self.cs.job_timeout_s, self.interrupt_now,
                                    f"job timeout ({self.cs.job_timeout_s:g} s, generation.job_timeout_s)")
        pending = iter(self.items)
        n = max(1, min(self.cs.concurrency, len(self.items)))
        try:
            self.tasks = [asyncio.create_task(self.worker(pending)) for _ in range(n)]
            results = await asyncio.gather(*self.tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
        finally:
            if timer is not None:
                timer.cancel()
            for sig in handlers:
                loop.remove_signal_handler(sig)

    async def worker(self, pending: Iterator[WorkItem]) -> None:
        """Sends one request at a time on its own client (one connection). With a ledger, the reservation of
        its next item is asked for as soon as the current request holds its own (see
        :meth:`LedgerSession.reserve_ahead`), so that the next request goes out the moment the
        current answer is stored instead of waiting a ledger transaction."""
        client = new_client(connect_timeout_s=min(30.0, self.cs.timeout_s), headers=self.headers)
        queue: list[tuple[WorkItem, asyncio.Future | None]] = []  # the next item, its reservation asked ahead

        def take_next() -> None:
            if not queue and (nxt := next(pending, None)) is not None:
                ledger = self.ledger
                ahead = None if ledger is None or self.halted else ledger.reserve_ahead(
                    self.reserve_usd[nxt.cache_key], item=nxt.id, cache_key=nxt.cache_key, attempt=1)
                queue.append((nxt, ahead))

        def drop_next() -> None:  # a retry must not wait behind this worker's own next reservation
            if queue and queue[0][1] is not None:
                self.ledger.give_back(queue[0][1])
                queue[0] = (queue[0][0], None)

        try:
            take_next()
            while queue and not self.halted:
                item, ahead = queue.pop()
                await self.claimed(item, client, ahead, take_next, drop_next)
                take_next()
        finally:
            for _, ahead in queue:
                if ahead is not None:
                    self.ledger.give_back(ahead)
            await client.aclose()

    async def claimed(self, item: WorkItem, client: Any, ahead: asyncio.Future | None,
                      on_reserved: Callable[[], None], drop_next: Callable[[], None]) -> None:
        """:meth:`process` of an item whose request this job claimed (:attr:`claims`: waiting,
        its reservation given back, while another dataset's job sends the same request); an answer
        another dataset's cache gained meanwhile is carried over instead of requested."""
        claims = self.claims
        if claims is None:
            return await self.process(item, client, ahead, on_reserved, drop_next)
        if not claims.waits:  # dedup: false: its own answer, claimed when free so that others may wait for it
            took = claims.try_claim(item.cache_key)
            try:
                return await self.process(item, client, ahead, on_reserved, drop_next)
            finally:
                if took:
                    claims.release(item.cache_key)
        if not claims.try_claim(item.cache_key):
            claims.waited += 1
            if ahead is not None:
                self.ledger.give_back(ahead, note="not sent: claimed by another dataset's job")
                ahead = None
            while not claims.try_claim(item.cache_key):
                if self.halted:
                    self.failures[item.id] = f"not started: {self.interrupt or self.stop_reason}"
                    return
                try:
                    await asyncio.wait_for(self.halt.wait(), CLAIM_POLL_S)
                except asyncio.TimeoutError:
                    pass
        try:
            found = claims.answer(item.cache_key)
            if found is None:
                return await self.process(item, client, ahead, on_reserved, drop_next)
            if ahead is not None:
                self.ledger.give_back(ahead, note="not sent: carried over from another dataset's cache")
            self.carry(item, *found)
        finally:
            claims.release(item.cache_key)

    def carry(self, item: WorkItem, dataset: str, rec: dict[str, Any]) -> None:
        """Another dataset's answer to ``item``'s request into the cache (as the start's carry-over
        does: :func:`eagledata.generate.carryover.carry_over`), counted, not paid."""
        rec.pop("ledger_ref", None)
        rec["carried_from"] = dataset
        self.cache.append(rec)
        self.claims.carried[dataset] = self.claims.carried.get(dataset, 0) + 1
        self.finished.add(item.id)
        self.progress.done += 1
        self.progress.ok += 1
        self.progress.update()

    async def process(self, item: WorkItem, client: Any, ahead: asyncio.Future | None = None,
                      on_reserved: Callable[[], None] | None = None, drop_next: Callable[[], None] | None = None) -> None:
        """All attempts of one item. ``ahead``: its reservation asked for in advance (``None`` as
        result: did not fit then, so ask and wait now; given back if never used); ``on_reserved``
        runs once the first attempt holds its reservation; ``drop_next`` gives back the worker's
        next reservation before a retry asks for one."""
        started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        t0 = time.monotonic()
        problem = "not started"
        try:
            for attempt in range(1, self.cs.max_attempts + 1):
                if attempt > 1 and self.halted:
                    problem += f" (no retry: {self.interrupt or self.stop_reason})"
                    break
                await self.gate.wait()
                ref = None
                if self.ledger is not None:
                    asked, ahead = ahead, None
                    ref, not_started = await self.reservation(item, attempt, asked, drop_next)
                    if ref is None:
                        problem = not_started
                        break
                if on_reserved is not None:
                    on_reserved()
                    on_reserved = None
                self.http_requests += 1
                self.progress.in_flight += 1
                try:
                    out = await self.attempt(item, client, ref, attempt, started, t0)
                finally:
                    self.progress.in_flight -= 1
                if out.kind in ("ok", "final"):
                    self.store(item, out)
                    return
                if out.kind == "fatal":
                    self.stop(f"{out.problem} (on {item.id})")
                    problem = out.problem
                    break
                problem = out.problem
                self.progress.retries += 1
                if attempt < self.cs.max_attempts:
                    await self.back_off(item, attempt, out)
            self.failures[item.id] = problem
        except asyncio.CancelledError:
            self.failures[item.id] = "cancelled while in flight"
            raise
        finally:
            if ahead is not None:  # never awaited (e.g. cancelled while a Retry-After held the gate)
                self.ledger.give_back(ahead)

    def store(self, item: WorkItem, out: Outcome) -> None:
        """An answer (success or final error) into the cache, the counts and the progress."""
        assert out.line is not None
        self.cache.append_line(item.cache_key, out.line)
        self.finished.add(item.id)
        self.progress.done += 1
        if out.kind == "ok":
            self.progress.ok += 1
            self.answers_ok += 1
            self.alike_finals = ((None, ""), 0)
        else:
            self.progress.final_errors += 1
            self.final_errors.append({"id": item.id, "status": out.status, "error": out.problem})
            self.log(f"{item.id}: HTTP {out.status} is final (not retried): {out.problem}")
            if item.cache_key not in self.cache.forgotten:  # else asked again on purpose (eagledata retry)
                self.stop_if_alike(out)
        self.progress.update()

    def stop_if_alike(self, out: Outcome) -> None:
        """Stop the job when its first :data:`ALIKE_FINAL_ERRORS_STOP` answers, or (after answers) its
        last :data:`ALIKE_FINAL_ERRORS_STOP_LATER` in a row, are the same final error: the message says
        how to request them again once fixed. Not called for a request ``eagledata retry`` asked for
        again: those failed before, and the prompts' own final errors among them (an upstream 400 that
        OpenRouter words alike for every prompt) would stop every retry run before the errors fixed
        meanwhile are asked. Alike means the same status and the same body, byte for byte: OpenRouter words
        every upstream 400 "Provider returned error", the provider's own message (a prompt's length)
        follows in ``metadata.raw``, and a moderation refusal quotes the flagged input."""
        seen, n = self.alike_finals
        n = n + 1 if seen == (out.status, out.body) else 1
        self.alike_finals = ((out.status, out.body), n)
        if n == (ALIKE_FINAL_ERRORS_STOP_LATER if self.answers_ok else ALIKE_FINAL_ERRORS_STOP):
            self.stop(f"the {'last' if self.answers_ok else 'first'} {n} answers were all the same final error "
                      f"({out.problem}): a setting or the provider rather than the prompts is likely the cause (the "
                      "model id, the provider routing, the account's data policy, the only provider allowed gone). "
                      f"Fix it, then request them again: {retry_command(self.work.settings.name, out.status)}")

    async def back_off(self, item: WorkItem, attempt: int, out: Outcome) -> None:
        """Wait before the next attempt (cut short when the job halts)."""
        delay = backoff_delay(attempt, self.cs.backoff_base_s, self.cs.backoff_max_s, out.retry_after)
        self.log(f"{item.id}: attempt {attempt}/{self.cs.max_attempts} failed: {out.problem}; retrying in {delay:.2f} s")
        try:
            await asyncio.wait_for(self.halt.wait(), delay)
        except asyncio.TimeoutError:
            pass

    async def reservation(self, item: WorkItem, attempt: int, ahead: asyncio.Future | None,
                          drop_next: Callable[[], None] | None) -> tuple[str | None, str]:
        """The reservation of one attempt: ``ahead``'s when it was granted, else one asked for now
        (waiting while the caps are full). Returns ``(ref, "")``, or ``(None, why not started)``
        when the budget, a stop, an interruption or a failed ledger write comes first."""
        ref = None
        try:
            if ahead is not None:
                try:
                    ref = await ahead
                except asyncio.CancelledError:
                    self.ledger.give_back(ahead)
                    raise
                if ref is not None:
                    self.ledger.claim(ref)
            elif attempt > 1 and drop_next is not None:
                drop_next()
            if ref is None:
                ref = await self.ledger.reserve(self.reserve_usd[item.cache_key], stop=self.halt, item=item.id,
                                                cache_key=item.cache_key, attempt=attempt)
        except BudgetExhausted as exc:
            self.stop(f"budget: {exc}")
            return None, "not started: budget"
        except LEDGER_WRITE_ERRORS as exc:
            self.write_failed(ledger_write_error(self.ledger.ledger.path, exc))
            return None, f"not started: {self.stop_reason}"
        if ref is None or self.halted:  # stopped or interrupted while waiting for the reservation
            if ref is not None:
                self.ledger.settle(ref, 0.0, note="not sent: job stopping")
            return None, f"not started: {self.stop_reason or self.interrupt}"
        return ref, ""

    def write_failed(self, what: str) -> None:
        """A cache or ledger write failed (a full disk): no new request starts; the answers in
        flight are kept (:meth:`ResponseCache.append_line`, then :func:`keep_paid_answers`)."""
        self.stop(f"{what}; answers received are kept")


    async def attempt(self, item: WorkItem, client: Any, ref: str | None, attempt: int, started: str, t0: float) -> Outcome:
        """One attempt: send, then settle or hold its reservation by what came back."""
        gen = GenerationId(self.ledger, ref, self.stream)
        try:
            resp = await send(client, "POST", self.cs.url, item.body_json.encode("utf-8"), timeout=self.cs.timeout_s,
                              on_head=gen.on_head, on_data=gen.on_data)
        except TransportError as exc:
            return self.transport_failed(exc, ref, gen.id)
        except asyncio.CancelledError:
            if ref is not None:
                self.ledger.orphan(ref, generation_id=gen.id, note="cancelled in flight")
            raise
        text = resp.body.decode("utf-8", errors="replace")
        ans = interpret(self.work.settings.backend, self.native, resp.status, text, item.request.get("input_ids"))
        gid = gen.id or ans.generation_id
        if resp.status in FINAL_STATUSES_FATAL and self.work.settings.backend == "openrouter":
            self.settle(ref, ans, gid, ans.cost or 0.0, note=f"HTTP {resp.status}")
            return Outcome("fatal", f"{FINAL_STATUSES_FATAL[resp.status]}: {ans.problem}")
        if ans.where == IDS_FATAL:  # every answer of this server would be so: retrying spends whole generations
            self.settle(ref, ans, gid, ans.cost or 0.0, note=ans.problem[:200])
            return Outcome("fatal", ans.problem)
        if ans.ok or (resp.status != 200 and not retryable_status(resp.status)):
            return self.answered(item, resp.status, text, ans, gid, ref, attempt, started, t0)
        return self.retry_answer(resp, ans, gid, ref)

    def transport_failed(self, exc: TransportError, ref: str | None, gid: str | None) -> Outcome:
        """No complete answer: a request certainly not sent gives its reservation back; any other
        may have been processed (and billed), so it stays held until reconciled."""
        if ref is not None:
            if not exc.sent:
                self.ledger.settle(ref, 0.0, note="not sent")
            elif isinstance(exc, AttemptTimeout):
                self.ledger.orphan(ref, generation_id=gid, note="timeout")
            else:
                self.ledger.orphan(ref, generation_id=gid, note=f"transport error: {exc}"[:200])
        if isinstance(exc, AttemptTimeout):
            detail = "" if exc.sent else f" (before the request was sent: {exc})"
            return Outcome("retry", f"timeout after {self.cs.timeout_s:g} s{detail}")
        return Outcome("retry", f"transport error ({exc})")

    def settle(self, ref: str | None, ans: Answer, gid: str | None, cost: float, **extra: Any) -> None:
        """Settle the attempt's reservation at ``cost`` with what the answer reported."""
        if ref is not None:
            self.ledger.settle(ref, cost, generation_id=gid, provider=ans.provider, prompt_tokens=ans.prompt_tokens,
                               completion_tokens=ans.completion_tokens, **extra)

    def answered(self, item: WorkItem, status: int, text: str, ans: Answer, gid: str | None, ref: str | None,
                 attempt: int, started: str, t0: float) -> Outcome:
        """A success or a final error: settled at its cost (reported, else priced from the token
        counts; 0 for an error), counted, and made into its cache line. A success that reports
        neither its cost nor both token counts (a stream cut after its last text, a body without
        ``usage``) was billed an unknown amount: its reservation stays held at its worst case until
        reconciled (its cache line's cost is null), never settled at a guess (but on a local SGLang
        server, which bills nothing and has no record to reconcile from)."""
        cost = ans.cost
        unknown = cost is None and ans.ok and (ans.prompt_tokens is None or ans.completion_tokens is None) \
            and self.work.settings.backend != "sglang"
        if unknown:
            if ref is not None:
                self.ledger.orphan(ref, generation_id=gid, note="answer without usage: its cost is unknown")
            self.unpriced += 1
        else:
            if cost is None:
                cost = self.price.cost(ans.prompt_tokens or 0, ans.completion_tokens or 0) if ans.ok else 0.0
            self.settle(ref, ans, gid, cost)
            if ans.ok:
                self.cost += cost
                self.prompt_tokens += ans.prompt_tokens or 0
                self.completion_tokens += ans.completion_tokens or 0
                self.progress.cost += cost
                if cost > self.reserve_usd[item.cache_key] + 1e-12:
                    self.over_reservation += 1
        if ans.ok:
            self.progress.completion_tokens += ans.completion_tokens or 0
        rec = {"id": item.id, "prompt_id": item.prompt_id, "sample_index": item.sample_index, "status": status,
               "url": self.cs.url, "cache_key": item.cache_key, "backend": self.cs.backend, "started_at": started,
               "elapsed_s": round(time.monotonic() - t0, 3), "attempts": attempt, "generation_id": gid,
               "token_ids": ans.extra.get("token_ids"),
               **{k: ans.extra[k] for k in ("prompt_token_ids", "token_ids_info") if k in ans.extra},
               "ledger_ref": ref, "cost": cost, "provider": ans.provider,
               **({SERVED_FIELD: self.served_model} if self.served_model else {})}
        if "messages" not in item.request:  # native SGLang: the same request in chat form
            rec["chat_request"] = item.chat_request
        return Outcome("ok" if ans.ok else "final", ans.problem, line=cache_line(rec, item.body_json, text), status=status,
                       body="" if ans.ok else text)

    def retry_answer(self, resp: Response, ans: Answer, gid: str | None, ref: str | None) -> Outcome:
        """A retryable answer (408/429/5xx, an error in a 200, a cut stream, a malformed body). An
        HTTP error is settled at the cost it reports (a provider may bill one), else 0."""
        status = resp.status
        if status != 200:
            self.settle(ref, ans, gid, ans.cost or 0.0, note=f"HTTP {status}")
            retry_after = retry_after_seconds(resp.headers.get("retry-after"))
            if status == 429 and retry_after:
                self.gate.hold(retry_after)
            return Outcome("retry", ans.problem, retry_after=retry_after, status=status)
        if ans.cost is not None:
            self.settle(ref, ans, gid, ans.cost, note=ans.problem[:200])
        elif ans.where in ("stream", "finish", "malformed") and ref is not None:
            # cut mid-stream, or a body that does not parse: the model may have generated (and the
            # provider billed) it, so it stays held until reconciled (by generation id when known)
            self.ledger.orphan(ref, generation_id=gid, note=f"{ans.where} failure without a cost: {ans.problem}"[:200])
        else:  # an error object in a 200 body: not billed
            self.settle(ref, ans, gid, 0.0, note=ans.problem[:200])
        return Outcome("retry", ans.problem, status=status)


def cache_line(rec: Mapping[str, Any], body_json: str, text: str) -> bytes:
    """One cache record: ``rec``'s fields, then the exact request body as sent (its JSON text
    embedded as is) and the exact response body received (as a JSON string)."""
    head = JSON_ENCODER.encode(rec)
    return f'{head[:-1]},"request":{body_json},"response_raw":{JSON_ENCODER.encode(text)}}}\n'.encode("utf-8")
