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

Real money and rehearsals are counted apart: a request to a billed backend (OpenRouter) counts in
its dataset's account, one to the stand-in (simulated costs) or a local SGLang server (its answers
priced at the model's price) in ``dataset@backend`` (:func:`account`), and each cap sums only the
accounts of the request's own backend. A rehearsal on the stand-in never uses up the real budget,
nor the reverse; ``eagledata budget`` (:mod:`eagledata.generate.budgetcli`) shows them apart. The
accounts' totals are kept by SQL triggers on the reservations, so a job of an earlier eagledata
still running keeps them right too (it keeps, and decides on, the per-dataset ``totals`` over every
backend, which this version keeps as well). The asynchronous side a generation job uses is
:mod:`eagledata.generate.ledgersession`.

Durability: each transaction is committed (WAL, ``synchronous=NORMAL``) before the request is sent,
so a killed process (even ``kill -9``) never loses a reservation; a power loss may lose the last
transactions.
"""

from __future__ import annotations

import os
import random
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from eagledata.errors import EagledataError

EPS = 1e-12
HOSTNAME = socket.gethostname()
LEDGER_NAME = "budget.sqlite"


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip()[:12]
        except OSError:
            continue
    return ""


def host_identity() -> str:
    """Where this process's pid means something: ``name/machine/boot/pidns``, the host name, its
    machine id, boot and PID namespace. Another container with the same host name is another host
    (its pids cannot be checked from here); the same machine under another boot is one whose
    processes are all gone. Without /proc (macOS): the bare host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        pidns = os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return HOSTNAME
    return "/".join([HOSTNAME, _machine_id(), boot, pidns])


HOST = host_identity()
#: This process's identity as eagledata wrote it for a while (``name/boot/pidns``): still checked here.
LEGACY_HOST = "/".join(p for i, p in enumerate(HOST.split("/")) if i != 1) if HOST.count("/") == 3 else HOST

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
KEY_USAGE_NOTE = "reconciled from key usage"  # the note of a row settled at a share of the key's unexplained spend
#: Backends whose spend is money paid on the API key (a reservation's ``backend``; none recorded: OpenRouter).
BILLED_BACKEND = "openrouter"


def _backend_sql(row: str = "") -> str:
    """The backend of a reservation row, in SQL (none recorded: the billed one)."""
    return f"COALESCE({row}backend, '{BILLED_BACKEND}')"


def _account_sql(row: str = "") -> str:
    """The account (:func:`account`) of a reservation row, in SQL (``row``: ``NEW.``/``OLD.`` in a trigger)."""
    return (f"CASE WHEN {_backend_sql(row)}='{BILLED_BACKEND}' THEN {row}dataset "
            f"ELSE {row}dataset || '@' || {row}backend END")


def format_usd(v: float, grouping: str = "") -> str:
    """Dollars to 4 places (``grouping``: ``","`` for thousands separators); a float sum's -0.0000
    (settled amounts cancelling, a residue of -1e-19) shown as 0."""
    return f"${round(v, 4) + 0.0:{grouping}.4f}"


def backend_totals(totals: Mapping[str, Mapping[str, float]], backend: str) -> tuple[float, float]:
    """(spent, held) over the accounts of ``backend`` in ``totals`` (:meth:`BudgetLedger.totals`)."""
    rows = [t for name, t in totals.items() if account_backend(name) == backend]
    return sum(t["spent"] for t in rows), sum(t["held"] for t in rows)


def _add_row_sql(row: str, sign: str) -> str:
    return (f"INSERT INTO account_totals(account, spent, held) VALUES({_account_sql(row)}, "
            f"{sign}(CASE WHEN {row}state='settled' THEN {row}cost ELSE 0 END), "
            f"{sign}(CASE WHEN {row}state IN ('reserved', 'orphaned') THEN {row}reserved ELSE 0 END)) "
            "ON CONFLICT(account) DO UPDATE SET spent=spent+excluded.spent, held=held+excluded.held")


#: Spent and held per account, kept by triggers on the reservations, so that every writer keeps
#: them right, whatever its version (an earlier eagledata still running keeps ``totals``, per
#: dataset over every backend, which this one keeps too).
_ACCOUNTS_SCHEMA = [
    "CREATE TABLE account_totals (account TEXT PRIMARY KEY, spent REAL NOT NULL DEFAULT 0, held REAL NOT NULL DEFAULT 0)",
    f"INSERT INTO account_totals(account, spent, held) SELECT {_account_sql()}, "
    "SUM(CASE WHEN state='settled' THEN cost ELSE 0 END), "
    "SUM(CASE WHEN state IN ('reserved', 'orphaned') THEN reserved ELSE 0 END) FROM reservations GROUP BY 1",
    f"CREATE TRIGGER account_totals_insert AFTER INSERT ON reservations BEGIN {_add_row_sql('NEW.', '+')}; END",
    "CREATE TRIGGER account_totals_update AFTER UPDATE OF dataset, backend, state, reserved, cost ON reservations "
    f"BEGIN {_add_row_sql('OLD.', '-')}; {_add_row_sql('NEW.', '+')}; END",
    f"CREATE TRIGGER account_totals_delete AFTER DELETE ON reservations BEGIN {_add_row_sql('OLD.', '-')}; END",
]


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
CHECKPOINT_INTERVAL_S = 0.25  # a generation job checkpoints the WAL this often, off the event loop
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
    assumed alive: their reservations are waited for (:class:`~eagledata.generate.ledgersession.LedgerSession`,
    for a while) and can be orphaned by hand (``eagledata budget --orphan-host``), except this
    machine's under an earlier boot, which are dead. A row of the bare host name was written before
    the identity named machine, boot and namespace: checked here, as it was then."""
    if host and host not in (HOST, HOSTNAME, LEGACY_HOST):
        mine, theirs = HOST.split("/"), host.split("/")
        # this machine (a known machine id) under an earlier boot: every process of that boot is gone
        return not (len(mine) == len(theirs) == 4 and mine[1] and theirs[:2] == mine[:2] and theirs[2] != mine[2])
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
    others_since: float | None = None  # when the oldest of them was made (time.time())
    hopeless: bool = False  # the settled spend alone leaves no room: no settlement can make it fit
    cap_account: str | None = None  # refused by this dataset account's cap (None: by budget_usd)


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
                    if not self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='account_totals'").fetchone():
                        for stmt in _ACCOUNTS_SCHEMA:  # once per ledger, with its reservations so far
                            self.db.execute(stmt)
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05 + random.random() * 0.1)

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
        """(dataset, state, reserved, cost) of a reservation."""
        return self.db.execute("SELECT dataset, state, reserved, cost FROM reservations WHERE ref=?", (ref,)).fetchone()

    def _settle(self, ref: str, cost: float, now: float, **fields: Any) -> bool:
        row = self._row(ref)
        if row is None or row[1] == "settled":
            return False
        dataset, state, reserved, _ = row
        sets = {k: v for k, v in fields.items() if v is not None}
        cols = "".join(f", {k}=?" for k in sets)
        self.db.execute(f"UPDATE reservations SET state='settled', cost=?, updated=?{cols} WHERE ref=?",
                        (cost, now, *sets.values(), ref))
        self._bump(dataset, spent=cost, held=-reserved if state in HELD_STATES else 0.0)
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

    def _others_in_flight(self, acct: str, dataset_cap: bool) -> tuple[int, str, float | None]:
        """Other processes' reservations in flight that count in the cap that refused a request of
        ``acct`` (its dataset's cap: that account's; ``budget_usd``: its backend's): how many, by
        process (for a message), and when the oldest was made."""
        which = f"{_account_sql()}=?" if dataset_cap else f"{_backend_sql()}=?"
        rows = self.db.execute("SELECT host, pid, COUNT(*), SUM(reserved), MIN(created) FROM reservations WHERE "
                               f"state='reserved' AND NOT (pid=? AND host=?) AND {which} GROUP BY host, pid ORDER BY host, pid",
                               (self.pid, HOST, acct if dataset_cap else account_backend(acct))).fetchall()
        return (sum(r[2] for r in rows), "; ".join(f"{h} pid {p}: {n} (${held:.4f})" for h, p, n, held, _ in rows[:5]),
                min((r[4] for r in rows), default=None))

    def orphan_host(self, host: str) -> int:
        """Orphan every reservation still in flight of processes on ``host`` (a host identity, or a
        host name for all its boots and namespaces): for a job that died on another machine, whose
        pids cannot be checked from here. They stay held until reconciled or released. This
        process's own host and namespace are left out: its pids are checked (:func:`pid_alive`)."""
        with self.transaction():
            return self.db.execute("UPDATE reservations SET state='orphaned', updated=?, note=COALESCE(note, ?) "
                                   "WHERE state='reserved' AND host!=? AND (host=? OR substr(host, 1, ?)=?)",
                                   (time.time(), "orphaned by hand: its host's job is gone", HOST, host, len(host) + 1,
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
                q = (f"SELECT ref, dataset, state, reserved, cost, COALESCE(note, '') LIKE '{KEY_USAGE_NOTE}%' "
                     f"FROM reservations WHERE ref IN ({','.join('?' * len(chunk))})")
                rows.update({r[0]: list(r[1:]) for r in self.db.execute(q, chunk)})
            delta: dict[str, list[float]] = {}  # dataset -> [spent, held] (the totals table)
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
                    # (a key-usage share is someone's unexplained spend, not this answer's: added to, not replaced)
                    cost = float(f.get("cost") or 0.0) + (row[3] if row[4] else 0.0)
                    if kind == "settle" and ref not in settled_here and abs(cost - row[3]) > EPS:
                        delta.setdefault(row[0], [0.0, 0.0])[0] += cost - row[3]
                        corrections.append((cost, now, f"settled at ${row[3]:.6f} before its answer arrived "
                                                        f"(reconciled or released); {'plus' if row[4] else 'now'} "
                                                        "its answer's cost", ref))
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
            if reserves:
                out = self._decide_reserves(reserves, now, delta)
            for ds, (dsp, dh) in delta.items():
                if dsp or dh:
                    self._bump(ds, spent=dsp, held=dh)
        return out

    def _decide_reserves(self, reserves: list[Reserve], now: float, delta: dict[str, list[float]]) -> list[Decision]:
        """Decide ``reserves`` in order against the accounts' totals as they stand (this batch's
        settlements applied), insert those granted and add them to ``delta`` (the totals table)."""
        totals = {a: {"spent": sp, "held": h} for a, sp, h in self.db.execute("SELECT account, spent, held FROM account_totals")}
        out, inserts, checked_others = [], [], False
        others: dict[tuple[str, bool], tuple[int, str, float | None]] = {}  # other processes' rows: same in a batch
        for r in reserves:
            acct = account(r.dataset, r.meta.get("backend"))
            d = self._decide(r, acct, totals)
            if not d.granted and not checked_others and not r.ahead:
                checked_others = True
                if self._mark_dead():  # held amounts unchanged; the in-flight count is now truthful
                    d = self._decide(r, acct, totals)
            if d.granted:
                totals.setdefault(acct, {"spent": 0.0, "held": 0.0})["held"] += r.amount
                delta.setdefault(r.dataset, [0.0, 0.0])[1] += r.amount
                m = r.meta
                inserts.append((r.ref, r.dataset, m.get("backend"), m.get("model"), m.get("item"), m.get("cache_key"),
                                m.get("attempt"), HOST, self.pid, r.amount, m.get("api_base"), now, now))
            elif not r.ahead:
                scope = (acct, d.cap_account is not None)
                if scope not in others:
                    others[scope] = self._others_in_flight(*scope)
                d.others_in_flight, d.others, d.others_since = others[scope]
            out.append(d)
        if inserts:
            self.db.executemany(
                "INSERT INTO reservations(ref, dataset, backend, model, item, cache_key, attempt, host, pid, state,"
                " reserved, cost, api_base, created, updated) VALUES(?,?,?,?,?,?,?,?,?,'reserved',?,0,?,?,?)", inserts)
        return out

    @staticmethod
    def _decide(r: Reserve, acct: str, totals: Mapping[str, Mapping[str, float]]) -> Decision:
        """Whether ``r`` (counting in ``acct``) fits the caps, each summing the accounts of its backend."""
        backend = account_backend(acct)
        s_all, h_all = backend_totals(totals, backend)
        own = totals.get(acct, {"spent": 0.0, "held": 0.0})
        s_ds, h_ds = own["spent"], own["held"]
        fill = AHEAD_MAX_FILL if r.ahead else 1.0  # asked ahead of need: only while each cap stays that far from full
        limit = "it" if fill == 1.0 else f"{fill:g} of it"
        if r.budget_usd is not None and s_all + h_all + r.amount > fill * r.budget_usd + EPS:
            what = "" if backend == BILLED_BACKEND else f" (the {backend} backend's own spend, counted apart from real spend)"
            return Decision(False, f"budget_usd {r.budget_usd:g}{what}: spent ${s_all:.4f} + held ${h_all:.4f} "
                                   f"+ this request's worst case ${r.amount:.4f} would pass {limit}",
                            hopeless=s_all + r.amount > r.budget_usd + EPS)
        if r.dataset_budget_usd is not None and s_ds + h_ds + r.amount > fill * r.dataset_budget_usd + EPS:
            return Decision(False, f"datasets.{r.dataset}.budget_usd {r.dataset_budget_usd:g}: spent ${s_ds:.4f} + "
                                   f"held ${h_ds:.4f} + this request's worst case ${r.amount:.4f} would pass {limit}",
                            hopeless=s_ds + r.amount > r.dataset_budget_usd + EPS, cap_account=acct)
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
                if info is not None and info.get("cost") is not None:  # (null: an answer without usage)
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
                                   f"generation_id IS NULL AND {_backend_sql()}='{BILLED_BACKEND}' AND "
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
                                    f"AND {_backend_sql()}='{BILLED_BACKEND}' AND (api_base=? OR api_base IS NULL)",
                                    (snap[0], api_base)).fetchone()[0]
            unexplained = max(0.0, usage_now - snap[1] - known)
            held = sum(r[1] for r in rows)
            share = min(1.0, unexplained / held) if held > 0 else 0.0
            for ref, reserved, _ in rows:
                self._settle(ref, reserved * share, now, note=f"{KEY_USAGE_NOTE} (share {share:.3f})")
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
        return {a: {"spent": s, "held": h}
                for a, s, h in self.db.execute("SELECT account, spent, held FROM account_totals ORDER BY account")}

    def billed_totals(self) -> tuple[float, float]:
        """(spent, held) of the billed backend over every dataset: what ``budget_usd`` caps."""
        return backend_totals(self.totals(), BILLED_BACKEND)

    def report(self) -> list[dict[str, Any]]:
        """Spend per dataset and provider (settled cost, held amounts, counts, tokens)."""
        q = (f"SELECT {_account_sql()} AS acct, COALESCE(provider, CASE WHEN state='settled' THEN '(no provider)' ELSE '(pending)' END) AS p, "
             "COUNT(*), SUM(state='settled' AND (prompt_tokens IS NOT NULL)), SUM(CASE WHEN state='settled' THEN cost ELSE 0 END), "
             "SUM(CASE WHEN state='reserved' THEN reserved ELSE 0 END), SUM(CASE WHEN state='orphaned' THEN reserved ELSE 0 END), "
             "SUM(state='orphaned'), COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0) "
             "FROM reservations GROUP BY acct, p ORDER BY acct, p")
        cols = ("dataset", "provider", "attempts", "answered", "spent_usd", "in_flight_usd", "orphaned_usd", "orphans",
                "prompt_tokens", "completion_tokens")
        return [dict(zip(cols, r)) for r in self.db.execute(q).fetchall()]


__all__ = ["BILLED_BACKEND", "BudgetExhausted", "BudgetLedger", "Decision", "LedgerBusy", "OTHERS_WAIT_S", "Reserve", "account",
           "account_backend", "backend_totals", "host_identity", "ledger_path", "pid_alive"]
