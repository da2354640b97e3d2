"""The budget ledger: one SQLite database (WAL mode) shared by every generation job of a cache dir.

Every request attempt first RESERVES its worst-case cost (prompt-token estimate + ``max_tokens`` at
the price bound, see :mod:`eagledata.generate.plan`) in ``{cache_dir}/budget.sqlite``, which is not a
Snakemake output. The reservation is granted only while ``spent + held + amount`` stays within
``budget_usd`` (all datasets) and the dataset's own ``budget_usd``; parallel jobs (separate
processes) serialise on SQLite's write lock, so the caps hold across them. When the answer arrives
the attempt is SETTLED at ``usage.cost`` (HTTP errors and errors in 200 bodies at their reported
cost, else 0, as OpenRouter does not bill them).

States of a row: ``reserved`` (in flight, counts as held), ``settled`` (counts its ``cost``),
``orphaned`` (the answer was lost: a timeout after sending, a stream cut mid-way or a 200 body that
does not parse, without a cost; a cancelled request, or a process that died; counts as held, i.e. as
spent, until reconciled). A reservation that certainly was not sent (connect failed, job stopped
first, asked ahead and never used) is settled at 0.
Orphans are reconciled (settled) from the response cache (the record carries the reservation's
``ledger_ref``), from ``GET /generation?id=`` when the generation id was recorded (``X-Generation-Id``
header, the JSON body's or the first stream chunk's ``id``), or from the key's usage delta
(``GET /key``) since a snapshot taken before they started; see :mod:`eagledata.cli` ``budget``.

Real money and rehearsals are counted apart: a request to a billed backend (OpenRouter) counts
in its dataset's totals row, one to the stand-in (simulated costs) or a local SGLang server (its
answers priced at the model's price) in ``dataset@backend`` (:func:`account`), and each cap sums
only the rows of the request's own backend. A rehearsal on the stand-in never uses up the real
budget, nor the reverse; ``eagledata budget`` shows them on separate lines.

Durability: each transaction is committed (WAL, ``synchronous=NORMAL``) before the request is sent,
so a killed process (even ``kill -9``) never loses a reservation; a power loss may lose the last
transactions.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sqlite3
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from eagledata.errors import EagledataError

EPS = 1e-12
HOSTNAME = socket.gethostname()
LEDGER_NAME = "budget.sqlite"


def host_identity() -> str:
    """Where this process's pid means something: the host name, its boot and its PID namespace
    (``name/boot/pidns``). Two containers that share a host name, or a host rebooted since, are
    other hosts: their pids cannot be checked from here."""
    parts = [HOSTNAME]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8])
        parts.append(os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]"))
    except OSError:
        return HOSTNAME
    return "/".join(parts)


HOST = host_identity()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    ref TEXT PRIMARY KEY,
    dataset TEXT NOT NULL,
    backend TEXT,
    model TEXT,
    item TEXT,
    cache_key TEXT,
    attempt INTEGER,
    host TEXT,
    pid INTEGER,
    state TEXT NOT NULL,
    reserved REAL NOT NULL,
    cost REAL NOT NULL DEFAULT 0,
    generation_id TEXT,
    api_base TEXT,
    provider TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    note TEXT
);
CREATE INDEX IF NOT EXISTS reservations_state ON reservations(state);
CREATE TABLE IF NOT EXISTS totals (
    dataset TEXT PRIMARY KEY,
    spent REAL NOT NULL DEFAULT 0,
    held REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS key_snapshots (
    ts REAL NOT NULL,
    api_base TEXT NOT NULL,
    usage REAL NOT NULL
);
"""

HELD_STATES = ("reserved", "orphaned")
#: Backends whose spend is money paid on the API key (a reservation's ``backend``; none recorded: OpenRouter).
BILLED_BACKEND = "openrouter"
#: The totals row (:func:`account`) of a reservation row, in SQL.
ACCOUNT_SQL = f"CASE WHEN COALESCE(backend, '{BILLED_BACKEND}')='{BILLED_BACKEND}' THEN dataset ELSE dataset || '@' || backend END"
#: The ledger's layout version (SQLite's user_version): 1 keeps other backends' totals apart.
LEDGER_VERSION = 1


def account(dataset: str, backend: str | None) -> str:
    """The totals row a request counts in: its dataset for a billed backend, ``dataset@backend``
    for the stand-in and a local server (dataset names never hold ``@``)."""
    return dataset if (backend or BILLED_BACKEND) == BILLED_BACKEND else f"{dataset}@{backend}"


def account_backend(name: str) -> str:
    """The backend of a totals row (:func:`account`)."""
    return name.partition("@")[2] or BILLED_BACKEND
# A reservation asked ahead (a worker's next request) is granted only while spent + held stays within
# this share of each cap: near a cap, requests reserve one at a time, so parallel jobs share the rest
# and none holds room it is not using yet.
AHEAD_MAX_FILL = 0.5
#: How long a request waits for budget that only other processes' requests in flight may free
#: (:meth:`LedgerSession.reserve`): longer than any live request takes (the generate job passes its
#: attempt timeout's worth more), short enough that a job that died on another host stops it.
OTHERS_WAIT_S = 900.0
CHECKPOINT_INTERVAL_S = 1.0  # a generation job checkpoints the WAL this often, off the event loop
DEFAULT_WAL_AUTOCHECKPOINT = 1000  # SQLite's default (pages)


class LedgerBusy(EagledataError):
    """Another process holds the ledger's write lock (raised by ``apply(..., wait=False)``; nothing
    was changed)."""


class BudgetExhausted(EagledataError):
    """No further request may start: the message names the cap and the amounts."""


def ledger_path(cache_dir: str | Path) -> Path:
    """The ledger of a cache dir: ``{cache_dir}/budget.sqlite``."""
    return Path(cache_dir) / LEDGER_NAME


def pid_alive(pid: int, host: str | None) -> bool:
    """Whether a reservation's process may still be running. Other hosts (:func:`host_identity`) are
    assumed alive: their reservations are waited for (:class:`LedgerSession` for a while) and can be
    orphaned by hand (``eagledata budget --orphan-host``). A row of the bare host name was written
    before the identity named boot and namespace: checked here, as it was then."""
    if host and host not in (HOST, HOSTNAME):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Reserve:
    ref: str
    dataset: str
    amount: float
    budget_usd: float | None
    dataset_budget_usd: float | None
    meta: dict[str, Any] = field(default_factory=dict)
    ahead: bool = False  # asked ahead of need: granted only if it fits now, never waits


@dataclass
class Decision:
    granted: bool
    reason: str = ""
    others_in_flight: int = 0  # live reservations of other processes (they may free budget)
    others: str = ""  # those reservations by process: "host pid: n ($held)", for a message


class BudgetLedger:
    """Synchronous access to the ledger; see the module docstring. Safe across processes; within
    one process use one instance from one thread at a time (:class:`LedgerSession` does)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=60, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout=60000")
        self.pid = os.getpid()
        # Jobs that start together race to create the file and switch it to WAL; SQLite answers the
        # loser of that race "database is locked" at once (no busy wait), so retry for a while.
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                with self.transaction():
                    for stmt in _SCHEMA.strip().split(";\n"):
                        if stmt.strip():
                            self.db.execute(stmt)
                    if self.db.execute("PRAGMA user_version").fetchone()[0] < LEDGER_VERSION:
                        self._rebuild_totals()
                        self.db.execute(f"PRAGMA user_version={LEDGER_VERSION}")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05 + random.random() * 0.1)

    def _rebuild_totals(self) -> None:
        """The totals from the reservations (a ledger written before :data:`LEDGER_VERSION`, when
        every backend counted in its dataset's row)."""
        self.db.execute("DELETE FROM totals")
        self.db.execute(f"INSERT INTO totals(dataset, spent, held) SELECT {ACCOUNT_SQL}, "
                        "SUM(CASE WHEN state='settled' THEN cost ELSE 0 END), "
                        "SUM(CASE WHEN state IN ('reserved', 'orphaned') THEN reserved ELSE 0 END) "
                        f"FROM reservations GROUP BY {ACCOUNT_SQL}")

    def close(self) -> None:
        self.db.close()

    def checkpoint(self) -> None:
        """Copy the WAL back into the database where no reader needs it (``PASSIVE``: never waits)."""
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # -- transactions ---------------------------------------------------------------------------
    class _Tx:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type: Any, *_: Any) -> None:
            self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")

    def transaction(self) -> "_Tx":
        return self._Tx(self.db)

    def _bump(self, dataset: str, spent: float = 0.0, held: float = 0.0) -> None:
        self.db.execute("INSERT INTO totals(dataset, spent, held) VALUES(?,?,?) ON CONFLICT(dataset) DO UPDATE SET "
                        "spent=spent+excluded.spent, held=held+excluded.held", (dataset, spent, held))

    # -- operations (call inside a transaction) --------------------------------------------------
    def _row(self, ref: str) -> tuple[str, str, float, float] | None:
        """(account, state, reserved, cost) of a reservation."""
        return self.db.execute(f"SELECT {ACCOUNT_SQL}, state, reserved, cost FROM reservations WHERE ref=?", (ref,)).fetchone()

    def _settle(self, ref: str, cost: float, now: float, **fields: Any) -> bool:
        row = self._row(ref)
        if row is None or row[1] == "settled":
            return False
        acct, state, reserved, _ = row
        sets = {k: v for k, v in fields.items() if v is not None}
        cols = "".join(f", {k}=?" for k in sets)
        self.db.execute(f"UPDATE reservations SET state='settled', cost=?, updated=?{cols} WHERE ref=?",
                        (cost, now, *sets.values(), ref))
        self._bump(acct, spent=cost, held=-reserved if state in HELD_STATES else 0.0)
        return True

    def _mark_dead(self) -> int:
        """Reservations of processes that no longer run become orphans (still held)."""
        n = 0
        rows = self.db.execute("SELECT DISTINCT pid, host FROM reservations WHERE state='reserved' AND NOT (pid=? AND host=?)",
                               (self.pid, HOST)).fetchall()
        for pid, host in rows:
            if not pid_alive(pid, host):
                n += self.db.execute("UPDATE reservations SET state='orphaned', updated=?, note=COALESCE(note, 'process died') "
                                     "WHERE state='reserved' AND pid=? AND host=?", (time.time(), pid, host)).rowcount
        return n

    def _others_in_flight(self) -> tuple[int, str]:
        rows = self.db.execute("SELECT host, pid, COUNT(*), SUM(reserved) FROM reservations WHERE state='reserved' "
                               "AND NOT (pid=? AND host=?) GROUP BY host, pid ORDER BY host, pid", (self.pid, HOST)).fetchall()
        return sum(r[2] for r in rows), "; ".join(f"{h} pid {p}: {n} (${held:.4f})" for h, p, n, held in rows[:5])

    def orphan_host(self, host: str) -> int:
        """Orphan every reservation still in flight of processes on ``host`` (a host identity, or a
        host name for all its boots and namespaces): for a job that died on another machine, whose
        pids cannot be checked from here. They stay held until reconciled or released."""
        with self.transaction():
            return self.db.execute("UPDATE reservations SET state='orphaned', updated=?, note=COALESCE(note, ?) "
                                   "WHERE state='reserved' AND (host=? OR substr(host, 1, ?)=?)",
                                   (time.time(), "orphaned by hand: its host's job is gone", host, len(host) + 1,
                                    f"{host}/")).rowcount

    # -- batched entry (one transaction) --------------------------------------------------------
    _SETTLE_SQL = ("UPDATE reservations SET state='settled', cost=?, updated=?, generation_id=COALESCE(?, generation_id), "
                   "provider=COALESCE(?, provider), prompt_tokens=COALESCE(?, prompt_tokens), "
                   "completion_tokens=COALESCE(?, completion_tokens), note=COALESCE(?, note) WHERE ref=?")
    _ORPHAN_SQL = ("UPDATE reservations SET state='orphaned', updated=?, generation_id=COALESCE(?, generation_id), "
                   "note=COALESCE(?, note) WHERE ref=? AND state='reserved'")
    _NOTE_SQL = "UPDATE reservations SET updated=?, generation_id=COALESCE(?, generation_id), note=COALESCE(?, note) WHERE ref=?"

    def apply(self, reserves: Iterable[Reserve], updates: Iterable[tuple[str, str, dict[str, Any]]],
              wait: bool = True) -> list[Decision]:
        """Apply ``updates`` (``(kind, ref, fields)``, kind ``settle`` | ``orphan`` | ``note``; fields
        ``cost``, ``generation_id``, ``provider``, ``prompt_tokens``, ``completion_tokens``, ``note``)
        in order, then decide ``reserves`` in order, all in one transaction with batched statements.
        ``wait=False``: raise :class:`LedgerBusy` at once (changing nothing) instead of waiting
        while another process holds the write lock."""
        reserves, updates = list(reserves), list(updates)
        if wait:
            return self._apply(reserves, updates)
        self.db.execute("PRAGMA busy_timeout=0")
        try:
            return self._apply(reserves, updates)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise LedgerBusy(str(exc)) from None
            raise
        finally:
            self.db.execute("PRAGMA busy_timeout=60000")

    def _apply(self, reserves: list[Reserve], updates: list[tuple[str, str, dict[str, Any]]]) -> list[Decision]:
        now = time.time()
        out: list[Decision] = []
        # a note (generation id seen in the headers) is moot when the same batch settles or orphans
        # its reservation with that id
        closing = {ref: f.get("generation_id") for kind, ref, f in updates if kind != "note"}
        with self.transaction():
            # rows touched by settlements: their dataset, state and reservation (for the totals)
            refs = list({ref for kind, ref, _ in updates if kind != "note"})
            rows: dict[str, list[Any]] = {}
            for i in range(0, len(refs), 500):
                chunk = refs[i:i + 500]
                q = f"SELECT ref, {ACCOUNT_SQL}, state, reserved, cost FROM reservations WHERE ref IN ({','.join('?' * len(chunk))})"
                rows.update({r[0]: list(r[1:]) for r in self.db.execute(q, chunk)})
            delta: dict[str, list[float]] = {}  # account -> [spent, held]
            settles, orphans, notes, corrections = [], [], [], []
            settled_here: set[str] = set()
            for kind, ref, f in updates:
                if kind == "note":
                    moot = ref in closing and closing[ref] == f.get("generation_id") and not f.get("note")
                    if not moot:
                        notes.append((now, f.get("generation_id"), f.get("note"), ref))
                    continue
                row = rows.get(ref)
                if row is None:
                    continue
                if row[1] == "settled":
                    # its own job's answer after another process settled it (a reconciliation or a
                    # release of what looked like an orphan): the answer's cost is what was paid
                    cost = float(f.get("cost") or 0.0)
                    if kind == "settle" and ref not in settled_here and abs(cost - row[3]) > EPS:
                        delta.setdefault(row[0], [0.0, 0.0])[0] += cost - row[3]
                        corrections.append((cost, now, f"settled at ${row[3]:.6f} before its answer arrived "
                                                        f"(reconciled or released); its answer's cost", ref))
                        row[3] = cost
                    continue
                if kind == "settle":
                    cost = float(f.get("cost") or 0.0)
                    d = delta.setdefault(row[0], [0.0, 0.0])
                    d[0] += cost
                    if row[1] in HELD_STATES:
                        d[1] -= row[2]
                    row[1], row[3] = "settled", cost
                    settled_here.add(ref)
                    settles.append((cost, now, f.get("generation_id"), f.get("provider"), f.get("prompt_tokens"),
                                    f.get("completion_tokens"), f.get("note"), ref))
                elif kind == "orphan" and row[1] == "reserved":
                    row[1] = "orphaned"
                    orphans.append((now, f.get("generation_id"), f.get("note"), ref))
            # statements in the order the updates came: notes and orphans never follow a settle of the same row
            if notes:
                self.db.executemany(self._NOTE_SQL, notes)
            if orphans:
                self.db.executemany(self._ORPHAN_SQL, orphans)
            if settles:
                self.db.executemany(self._SETTLE_SQL, settles)
            if corrections:
                self.db.executemany("UPDATE reservations SET cost=?, updated=?, note=? WHERE ref=?", corrections)
            # reservations, decided against totals read once
            if reserves:
                totals = {ds: [sp, h] for ds, sp, h in self.db.execute("SELECT dataset, spent, held FROM totals")}
                for ds, (dsp, dh) in delta.items():
                    t = totals.setdefault(ds, [0.0, 0.0])
                    t[0] += dsp
                    t[1] += dh
                inserts = []
                checked_others = False
                for r in reserves:
                    acct = account(r.dataset, r.meta.get("backend"))
                    d = self._decide(r, acct, totals)
                    if not d.granted and not checked_others and not r.ahead:
                        checked_others = True
                        if self._mark_dead():  # held amounts unchanged; the in-flight count is now truthful
                            d = self._decide(r, acct, totals)
                    if d.granted:
                        t = totals.setdefault(acct, [0.0, 0.0])
                        t[1] += r.amount
                        delta.setdefault(acct, [0.0, 0.0])[1] += r.amount
                        m = r.meta
                        inserts.append((r.ref, r.dataset, m.get("backend"), m.get("model"), m.get("item"), m.get("cache_key"),
                                        m.get("attempt"), HOST, self.pid, r.amount, m.get("api_base"), now, now))
                    elif not r.ahead:
                        d.others_in_flight, d.others = self._others_in_flight()
                    out.append(d)
                if inserts:
                    self.db.executemany(
                        "INSERT INTO reservations(ref, dataset, backend, model, item, cache_key, attempt, host, pid, state,"
                        " reserved, cost, api_base, created, updated) VALUES(?,?,?,?,?,?,?,?,?,'reserved',?,0,?,?,?)", inserts)
            for ds, (dsp, dh) in delta.items():
                if dsp or dh:
                    self._bump(ds, spent=dsp, held=dh)
        return out

    @staticmethod
    def _decide(r: Reserve, acct: str, totals: Mapping[str, list[float]]) -> Decision:
        """Whether ``r`` (counting in ``acct``) fits the caps, each summing the accounts of its backend."""
        backend = account_backend(acct)
        same = [t for name, t in totals.items() if account_backend(name) == backend]
        s_all, h_all = sum(t[0] for t in same), sum(t[1] for t in same)
        s_ds, h_ds = totals.get(acct, (0.0, 0.0))
        fill = AHEAD_MAX_FILL if r.ahead else 1.0  # asked ahead of need: only while each cap stays that far from full
        limit = "it" if fill == 1.0 else f"{fill:g} of it"
        if r.budget_usd is not None and s_all + h_all + r.amount > fill * r.budget_usd + EPS:
            what = "" if backend == BILLED_BACKEND else f" (the {backend} backend's own spend, counted apart from real spend)"
            return Decision(False, f"budget_usd {r.budget_usd:g}{what}: spent ${s_all:.4f} + held ${h_all:.4f} "
                                   f"+ this request's worst case ${r.amount:.4f} would pass {limit}")
        if r.dataset_budget_usd is not None and s_ds + h_ds + r.amount > fill * r.dataset_budget_usd + EPS:
            return Decision(False, f"datasets.{r.dataset}.budget_usd {r.dataset_budget_usd:g}: spent ${s_ds:.4f} + "
                                   f"held ${h_ds:.4f} + this request's worst case ${r.amount:.4f} would pass {limit}")
        return Decision(True)

    # -- recovery and reconciliation ------------------------------------------------------------
    def recover(self, dataset: str, cached: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        """At job start: orphan the reservations of dead processes, and settle this dataset's
        orphans whose response is in the cache (``cached``: ledger_ref -> {cost, provider, ...})."""
        now = time.time()
        with self.transaction():
            dead = self._mark_dead()
            settled = 0
            for (ref,) in self.db.execute("SELECT ref FROM reservations WHERE dataset=? AND state='orphaned'",
                                          (dataset,)).fetchall():
                info = cached.get(ref)
                if info is not None:
                    settled += self._settle(ref, float(info.get("cost") or 0.0), now, provider=info.get("provider"),
                                            generation_id=info.get("generation_id"), note="recovered from cache")
        return {"dead": dead, "recovered": settled}

    def orphans(self, dataset: str | None = None, with_generation_id: bool | None = None) -> list[dict[str, Any]]:
        q = "SELECT ref, dataset, generation_id, api_base, reserved, created, note FROM reservations WHERE state='orphaned'"
        args: list[Any] = []
        if dataset is not None:
            q += " AND dataset=?"
            args.append(dataset)
        if with_generation_id is True:
            q += " AND generation_id IS NOT NULL"
        elif with_generation_id is False:
            q += " AND generation_id IS NULL"
        cols = ("ref", "dataset", "generation_id", "api_base", "reserved", "created", "note")
        return [dict(zip(cols, r)) for r in self.db.execute(q, args).fetchall()]

    def settle(self, ref: str, cost: float, **fields: Any) -> bool:
        with self.transaction():
            return self._settle(ref, cost, time.time(), **fields)

    def add_key_snapshot(self, api_base: str, usage: float) -> None:
        with self.transaction():
            self.db.execute("INSERT INTO key_snapshots(ts, api_base, usage) VALUES(?,?,?)", (time.time(), api_base, usage))

    def reconcile_by_key_usage(self, api_base: str, usage_now: float) -> dict[str, Any]:
        """Settle orphans without a generation id from the key's usage: for the latest snapshot
        taken before the oldest such orphan, the unexplained spend is ``usage_now - snapshot -
        (costs settled since, of requests sent to ``api_base`` with the key: never a stand-in's)``; the orphans are settled at ``min(their reservations, that)``,
        shared in proportion to their reservations (conservative: other use of the key counts as
        theirs)."""
        now = time.time()
        with self.transaction():
            # orphans of requests sent with the key to ``api_base``: a stand-in's or SGLang's are not
            rows = self.db.execute("SELECT ref, reserved, created FROM reservations WHERE state='orphaned' AND "
                                   "generation_id IS NULL AND COALESCE(backend, 'openrouter')='openrouter' AND "
                                   "(api_base=? OR api_base IS NULL)", (api_base,)).fetchall()
            if not rows:
                return {"orphans": 0, "settled": 0}
            oldest = min(r[2] for r in rows)
            snap = self.db.execute("SELECT ts, usage FROM key_snapshots WHERE api_base=? AND ts<=? ORDER BY ts DESC LIMIT 1",
                                   (api_base, oldest)).fetchone()
            if snap is None:
                return {"orphans": len(rows), "settled": 0, "reason": "no key-usage snapshot older than the orphans"}
            # only what this key paid for: a stand-in's or SGLang's simulated costs sharing the ledger are not
            known = self.db.execute("SELECT COALESCE(SUM(cost),0) FROM reservations WHERE state='settled' AND created>=? "
                                    "AND COALESCE(backend, 'openrouter')='openrouter' AND (api_base=? OR api_base IS NULL)",
                                    (snap[0], api_base)).fetchone()[0]
            unexplained = max(0.0, usage_now - snap[1] - known)
            held = sum(r[1] for r in rows)
            share = min(1.0, unexplained / held) if held > 0 else 0.0
            for ref, reserved, _ in rows:
                self._settle(ref, reserved * share, now, note=f"reconciled from key usage (share {share:.3f})")
            return {"orphans": len(rows), "settled": len(rows), "unexplained_usd": unexplained, "held_usd": held}

    def release_orphans(self, refs: Iterable[str] | None = None) -> int:
        """Settle orphans at cost 0 (after checking the provider's dashboard): all, or ``refs``."""
        now = time.time()
        with self.transaction():
            if refs is None:
                refs = [r for (r,) in self.db.execute("SELECT ref FROM reservations WHERE state='orphaned'").fetchall()]
            return sum(self._settle(ref, 0.0, now, note="released by hand") for ref in refs)

    # -- queries --------------------------------------------------------------------------------
    def totals(self) -> dict[str, dict[str, float]]:
        """Spent and held per account (:func:`account`: a dataset's real spend under its name)."""
        return {ds: {"spent": s, "held": h} for ds, s, h in self.db.execute("SELECT dataset, spent, held FROM totals ORDER BY dataset")}

    def billed_totals(self) -> tuple[float, float]:
        """(spent, held) of the billed backend over every dataset: what ``budget_usd`` caps."""
        t = [v for k, v in self.totals().items() if account_backend(k) == BILLED_BACKEND]
        return sum(v["spent"] for v in t), sum(v["held"] for v in t)

    def report(self) -> list[dict[str, Any]]:
        """Spend per dataset and provider (settled cost, held amounts, counts, tokens)."""
        q = ("SELECT dataset, COALESCE(provider, CASE WHEN state='settled' THEN '(no provider)' ELSE '(pending)' END) AS p, "
             "COUNT(*), SUM(state='settled' AND (prompt_tokens IS NOT NULL)), SUM(CASE WHEN state='settled' THEN cost ELSE 0 END), "
             "SUM(CASE WHEN state='reserved' THEN reserved ELSE 0 END), SUM(CASE WHEN state='orphaned' THEN reserved ELSE 0 END), "
             "SUM(state='orphaned'), COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0) "
             "FROM reservations GROUP BY dataset, p ORDER BY dataset, p")
        cols = ("dataset", "provider", "attempts", "answered", "spent_usd", "in_flight_usd", "orphaned_usd", "orphans",
                "prompt_tokens", "completion_tokens")
        return [dict(zip(cols, r)) for r in self.db.execute(q).fetchall()]


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
        other processes: for at most :attr:`others_wait_s` while only theirs are, since a job that
        died on another host never settles); raises :class:`BudgetExhausted` when it cannot fit;
        returns ``None`` if ``stop`` is set while it waits."""
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
            if self.in_flight == 0 and decision.others_in_flight == 0:
                raise BudgetExhausted(decision.reason)
            if self.in_flight:
                waiting_since = None
            elif waiting_since is None:
                waiting_since = time.monotonic()
            elif time.monotonic() - waiting_since > self.others_wait_s:
                raise BudgetExhausted(
                    f"{decision.reason}; waited {self.others_wait_s:g} s for {decision.others_in_flight} reservation(s) "
                    f"of other processes that never settled ({decision.others}). If those jobs are gone (a job killed "
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

    def give_back(self, ahead: asyncio.Future) -> None:
        """Release a :meth:`reserve_ahead` whose request was never sent (settled at 0)."""
        if not ahead.done():
            ahead.cancel()  # a grant arriving later is settled at 0 by _finish
        elif not ahead.cancelled() and ahead.exception() is None and ahead.result() is not None:
            self.settle(ahead.result(), 0.0, note="not sent: job ended")

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


def format_report(rows: list[dict[str, Any]], totals: Mapping[str, Mapping[str, float]], budget_usd: float | None,
                  dataset_budgets: Mapping[str, float | None]) -> str:
    """The ``eagledata budget`` table: spent and held per dataset, the caps and what is left."""
    head = f"{'dataset':<16} {'provider':<22} {'attempts':>8} {'spent':>11} {'in flight':>11} {'orphaned':>11} {'tokens in/out':>21}"
    lines = [head, "-" * len(head)]
    for r in rows:
        usd = [f"${r[k]:.4f}" for k in ("spent_usd", "in_flight_usd", "orphaned_usd")]
        lines.append(f"{r['dataset']:<16} {str(r['provider'])[:22]:<22} {r['attempts']:>8} {usd[0]:>11} {usd[1]:>11} "
                     f"{usd[2]:>11} {str(r['prompt_tokens']) + '/' + str(r['completion_tokens']):>21}")
    billed = [t for k, t in totals.items() if account_backend(k) == BILLED_BACKEND]
    spent, held = sum(t["spent"] for t in billed), sum(t["held"] for t in billed)
    lines.append(f"total: spent ${spent:.4f}, held ${held:.4f} (in flight + orphaned, counted as spent until reconciled)")
    for backend in sorted({account_backend(k) for k in totals} - {BILLED_BACKEND}):
        other = [t for k, t in totals.items() if account_backend(k) == backend]
        lines.append(f"{backend} (not billed; capped apart from real spend): spent ${sum(t['spent'] for t in other):.4f}, "
                     f"held ${sum(t['held'] for t in other):.4f}")
    if budget_usd is not None:
        lines.append(f"budget_usd {budget_usd:g}: remaining ${budget_usd - spent - held:.4f}")
    for ds, cap in dataset_budgets.items():
        if cap is not None:
            t = totals.get(ds, {"spent": 0.0, "held": 0.0})
            lines.append(f"datasets.{ds}.budget_usd {cap:g}: remaining ${cap - t['spent'] - t['held']:.4f}")
    return "\n".join(lines)


def cmd_budget(args: Any) -> int:
    """``eagledata budget [--orphan-host HOST] [--reconcile] [--release-orphans] [--json]``."""
    import asyncio
    import json
    import sys

    from eagledata.config import load_config

    config = load_config(args.config)
    path = ledger_path(config["cache_dir"])
    if not path.exists():
        print(f"eagledata budget: no ledger yet at {path} (nothing was generated with this cache_dir)", file=sys.stderr)
        return 0 if not (args.reconcile or args.release_orphans or args.orphan_host) else 2
    ledger = BudgetLedger(path)
    try:
        notes = [f"orphaned {ledger.orphan_host(host)} reservation(s) in flight on host {host}" for host in args.orphan_host]
        if args.reconcile:
            from eagledata.generate.errors import GenerationError
            from eagledata.generate.openrouter import api_key, key_usage, reconcile_generations

            try:
                headers = {"Authorization": f"Bearer {api_key('eagledata budget --reconcile')}"}
            except GenerationError as exc:
                print(exc, file=sys.stderr)
                return 2
            bases = sorted({r["api_base"] for r in ledger.orphans() if r["api_base"]})
            for base in bases:
                notes.append(f"{base}: /generation: {asyncio.run(reconcile_generations(ledger, base, headers))}")
                usage = asyncio.run(key_usage(base, headers))
                if usage is not None:
                    notes.append(f"{base}: /key usage ${usage:.4f}: {ledger.reconcile_by_key_usage(base, usage)}")
            if not bases:
                notes.append("no orphaned reservation to reconcile")
        if args.release_orphans:
            notes.append(f"released {ledger.release_orphans()} orphaned reservation(s) at $0")
        rows, totals = ledger.report(), ledger.totals()
        caps = {ds: (config["datasets"].get(ds) or {}).get("budget_usd") for ds in config["datasets"]}
        if args.json:
            print(json.dumps({"ledger": str(path), "budget_usd": config.get("budget_usd"), "rows": rows, "totals": totals,
                              "orphans": ledger.orphans(), "notes": notes}, indent=1))
        else:
            for n in notes:
                print(n)
            print(format_report(rows, totals, config.get("budget_usd"), caps))
            orphans = ledger.orphans()
            if orphans:
                print(f"{len(orphans)} orphaned reservation(s) (answers lost: timeouts, cancelled or killed jobs); "
                      f"`eagledata budget --reconcile` settles them from OpenRouter")
    finally:
        ledger.close()
    return 0
