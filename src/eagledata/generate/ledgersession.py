"""A generation job's asynchronous view of the budget ledger (:mod:`eagledata.generate.budget`):
reservations and settlements of many requests batched into one transaction, run off the event loop
when another process holds the ledger's write lock."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from eagledata.generate.budget import (CHECKPOINT_INTERVAL_S, DEFAULT_WAL_AUTOCHECKPOINT, OTHERS_WAIT_S, BudgetExhausted,
                                       BudgetLedger, Decision, LedgerBusy, Reserve)

_REF_PREFIX = f"{uuid.uuid4().hex[:16]}-"
_REF_COUNTER = iter(range(1 << 62))


def new_ref() -> str:
    """A reservation id, unique across processes (random per-process prefix + counter)."""
    return f"{_REF_PREFIX}{next(_REF_COUNTER):x}"


class LedgerSession:
    """A generation job's asynchronous view of the ledger: reservations and settlements are
    batched into one transaction per flush, run on one background thread (SQLite releases the GIL,
    so the event loop keeps serving responses while another process holds the write lock)."""

    def __init__(self, ledger: BudgetLedger, dataset: str, budget_usd: float | None, dataset_budget_usd: float | None,
                 meta: Mapping[str, Any] | None = None, coalesce_s: float = 0.002, others_wait_s: float = OTHERS_WAIT_S):
        self.ledger, self.dataset = ledger, dataset
        self.others_wait_s = others_wait_s
        self.budget_usd, self.dataset_budget_usd = budget_usd, dataset_budget_usd
        self.meta = dict(meta or {})
        self._reserves: list[tuple[Reserve, asyncio.Future]] = []
        self._updates: list[tuple[str, str, dict[str, Any]]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._flushing: asyncio.Future | None = None
        self._freed = asyncio.Event()
        self.spent = 0.0  # settled by this session
        self.error: BaseException | None = None  # the first failed ledger write (raised again by close())
        self.on_error: Callable[[BaseException], None] | None = None  # told of that failure at once
        self._open: set[str] = set()  # granted, neither settled nor orphaned yet
        self._unclaimed: set[str] = set()  # of those, asked ahead and not yet claimed for a request
        self._released = 0  # settlements so far (a refused reservation asks again if one came since)
        self._timer: asyncio.TimerHandle | None = None
        self.coalesce_s = coalesce_s
        # SQLite would checkpoint the WAL inside whichever commit fills it, on the event loop's
        # thread when the lock was free; the session checkpoints on its background thread instead
        ledger.db.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpointed = time.monotonic()

    # -- public ---------------------------------------------------------------------------------
    async def reserve(self, amount: float, stop: asyncio.Event | None = None, **meta: Any) -> str | None:
        """Reserve ``amount``; waits while budget may be freed by requests in flight (here or in
        other processes); raises :class:`BudgetExhausted` when it cannot fit, or when it waited
        :attr:`others_wait_s` on other processes' reservations only and one of them is older than
        that (no live request is: a job that died on another host never settles); returns ``None``
        if ``stop`` is set while it waits."""
        waiting_since: float | None = None  # since when only other processes' requests may free budget
        while True:
            released = self._released
            ref = new_ref()
            fut = asyncio.get_running_loop().create_future()
            self._reserves.append((Reserve(ref, self.dataset, amount, self.budget_usd, self.dataset_budget_usd,
                                           {**self.meta, **meta}), fut))
            self._kick()
            decision: Decision = await fut
            if decision.granted:
                return ref
            if self._released != released:
                continue  # a settlement came after the decision's batch: ask again at once
            # nothing of this job in flight, and no other job's request that counts in the refusing cap
            # (or the settled spend alone leaves no room): no settlement can make it fit. With requests
            # of its own in flight it waits for them (a smaller request of this job may fit after).
            if self.in_flight == 0 and (decision.hopeless or decision.others_in_flight == 0):
                raise BudgetExhausted(decision.reason)
            stale = decision.others_since is not None and time.time() - decision.others_since > self.others_wait_s
            if self.in_flight:
                waiting_since = None
            elif waiting_since is None:
                waiting_since = time.monotonic()
            elif time.monotonic() - waiting_since > self.others_wait_s and stale:
                raise BudgetExhausted(
                    f"{decision.reason}; waited {self.others_wait_s:g} s for {decision.others_in_flight} reservation(s) "
                    f"of other processes, some older than that ({decision.others}). If those jobs are gone (a job killed "
                    "on another machine), orphan them: eagledata budget --orphan-host HOST (then --reconcile)")
            # requests in flight may settle below their worst case: wait for one, then ask again
            self._freed.clear()
            waits = [asyncio.ensure_future(self._freed.wait())]
            if stop is not None:
                waits.append(asyncio.ensure_future(stop.wait()))
            try:
                await asyncio.wait(waits, timeout=0.25 if decision.others_in_flight else None,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if stop is not None and stop.is_set():
                return None

    def reserve_ahead(self, amount: float, **meta: Any) -> asyncio.Future:
        """Ask now for a reservation that will be needed soon (a worker's next request, asked while
        its current one is in flight, so that it goes out without waiting for the ledger). The
        future's result is the reservation's ref when ``amount`` fits at once within
        :data:`AHEAD_MAX_FILL` of the caps, else ``None`` (then :meth:`reserve` when the time comes). A granted ref that ends up unused must be handed to
        :meth:`give_back`; until then it is held like any reservation."""
        fut = asyncio.get_running_loop().create_future()
        self._reserves.append((Reserve(new_ref(), self.dataset, amount, self.budget_usd, self.dataset_budget_usd,
                                       {**self.meta, **meta}, ahead=True), fut))
        self._kick()
        return fut

    def claim(self, ref: str) -> None:
        """A :meth:`reserve_ahead` ref is now used for its request (counts as in flight)."""
        self._unclaimed.discard(ref)

    def give_back(self, ahead: asyncio.Future, note: str = "not sent: job ended") -> None:
        """Release a :meth:`reserve_ahead` whose request was never sent (settled at 0, with ``note``)."""
        if not ahead.done():
            ahead.cancel()  # a grant arriving later is settled at 0 by _finish
        elif not ahead.cancelled() and ahead.exception() is None and ahead.result() is not None:
            self.settle(ahead.result(), 0.0, note=note)

    def note(self, ref: str, **fields: Any) -> None:
        self._updates.append(("note", ref, fields))
        self._kick()

    def settle(self, ref: str, cost: float, **fields: Any) -> None:
        self._close_ref(ref)
        self._released += 1
        self.spent += cost
        self._updates.append(("settle", ref, {"cost": cost, **fields}))
        self._kick()

    def orphan(self, ref: str, **fields: Any) -> None:
        self._close_ref(ref)
        self._updates.append(("orphan", ref, fields))
        self._kick()

    @property
    def in_flight(self) -> int:
        """Granted reservations in use (a reservation asked ahead counts once claimed): the ones
        whose settlement may still free budget for a waiting request."""
        return len(self._open) - len(self._unclaimed)

    def _close_ref(self, ref: str) -> None:
        self._open.discard(ref)
        self._unclaimed.discard(ref)
        self._freed.set()

    async def flush(self) -> None:
        while self._flushing is not None or self._reserves or self._updates:
            if self._flushing is None:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                self._start_flush()
            fut = self._flushing
            if fut is not None and not fut.done():
                await asyncio.wait([fut])
            await asyncio.sleep(0)  # lets the done callback run

    async def close(self, note: str = "job ended with the request in flight") -> None:
        """Flush; reservations asked ahead and never claimed are settled at 0 (never sent); the
        others still open (cancelled requests) become orphans."""
        await self.flush()  # decisions still pending land first
        for ref in list(self._unclaimed):
            self.settle(ref, 0.0, note="not sent: job ended")
        for ref in list(self._open):
            self.orphan(ref, note=note)
        await self.flush()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.ledger.checkpoint)
        except (sqlite3.Error, OSError) as exc:  # a full disk: the committed transactions stay in the WAL
            self.error = self.error or exc
        self._executor.shutdown(wait=True)
        self.ledger.db.execute(f"PRAGMA wal_autocheckpoint={DEFAULT_WAL_AUTOCHECKPOINT}")
        if self.error is not None:
            raise self.error

    # -- batching -------------------------------------------------------------------------------
    def _kick(self) -> None:
        """Start a flush soon: ``coalesce_s`` later, so that one transaction carries the
        reservations and settlements of many requests (a reservation waits at most that long)."""
        if self._timer is None and self._flushing is None and (self._reserves or self._updates):
            self._timer = asyncio.get_running_loop().call_later(self.coalesce_s, self._start_flush)

    def _start_flush(self) -> None:
        """Apply the pending batch: on the event loop's thread when the ledger's write lock is free
        (one short transaction, no thread handoff), else on the background thread, which waits for
        the lock without stalling the loop."""
        self._timer = None
        if self._flushing is None and (self._reserves or self._updates):
            reserves, self._reserves = self._reserves, []
            updates, self._updates = self._updates, []
            batch = [r for r, _ in reserves]
            checkpoint = time.monotonic() - self._checkpointed >= CHECKPOINT_INTERVAL_S  # due: the thread does it
            if not checkpoint:
                try:
                    decisions = self.ledger.apply(batch, updates, wait=False)
                except LedgerBusy:
                    pass
                except Exception as exc:  # noqa: BLE001 - reported to every waiter and at close()
                    self._finish(None, exc, reserves)
                    return
                else:
                    self._finish(decisions, None, reserves)
                    return
            else:
                self._checkpointed = time.monotonic()
            fut = asyncio.get_running_loop().run_in_executor(self._executor, self._apply_in_thread, batch, updates, checkpoint)
            self._flushing = fut
            fut.add_done_callback(lambda f: self._finish(None if f.exception() else f.result(), f.exception(), reserves))

    def _apply_in_thread(self, batch: list[Reserve], updates: list[tuple[str, str, dict[str, Any]]],
                         checkpoint: bool) -> list[Decision]:
        out = self.ledger.apply(batch, updates)
        if checkpoint:
            self.ledger.checkpoint()
        return out

    def _finish(self, decisions: list[Decision] | None, exc: BaseException | None,
                reserves: list[tuple[Reserve, asyncio.Future]]) -> None:
        self._flushing = None
        if exc is not None and self.error is None:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
        for i, (r, waiter) in enumerate(reserves):
            decision = None if decisions is None else decisions[i]
            granted = decision is not None and decision.granted
            if waiter.done():  # its requester was cancelled: the request was never sent
                if granted:
                    self.settle(r.ref, 0.0, note="not sent: cancelled before the reservation was granted")
                continue
            if granted:
                self._open.add(r.ref)
                if r.ahead:
                    self._unclaimed.add(r.ref)
            if exc is not None:
                waiter.set_exception(exc)
            elif r.ahead:
                waiter.set_result(r.ref if granted else None)
            else:
                waiter.set_result(decision)
        self._kick()


__all__ = ["LedgerSession", "new_ref"]
