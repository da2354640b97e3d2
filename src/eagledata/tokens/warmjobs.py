"""Warm workers for the per-shard token jobs (rule ``token_shard``).

A shard job spends about 0.4 s before its first sample: the interpreter, the stage's imports (polars
0.12 s of them), the tokenizer (tiktoken's CoreBPE 0.1 s, its ranks 0.04 s) and the chat template's
compile. On the recorded traffic's short samples that is half of the stage's time; at drafter-training
size (thousands of shards) it is hours of CPU. A *warm worker* is a process that paid it once and then
runs shard jobs one after another, each as its own process would: the same function
(:func:`eagledata.tokens.pershard.run_shard_job`), in the job's working directory, with its environment
and its log file, its peak memory measured from the job's start (``/proc/self/clear_refs``). A job's
outputs are a function of its inputs only (what stays in a worker between jobs is the code, the tokenizer
and caches of pure functions), so a job run in a worker writes the bytes a fresh process writes (tested).

How a job finds one (:func:`main`, called by ``scripts/token_shard.py`` before any heavy import; this module
imports only the standard library's C cores of json, socket and hashlib, about 0.011 s a job in all with the
interpreter's own start, 0.01 s: the worker's side is
:mod:`eagledata.tokens.warmworker`):

- Workers are keyed by what decides the code and tokenizer they hold: the interpreter, ``PYTHONPATH``,
  the working directory, the eagledata package's location, the job's stage stamp (content-named: new
  code or tokenizer settings make a new stamp, so new workers; the old ones idle out) and when the
  installed libraries last changed (:func:`installed_libraries`). A key has one
  *slot* per CPU; a job takes a free slot with an exclusive ``flock`` on its lock file (in a directory
  only this user may enter, under ``$XDG_RUNTIME_DIR``, ``$TMPDIR`` or /tmp), so a worker runs one job
  at a time and ``--cores N`` keeps N workers busy.
- It connects to its slot's worker (an abstract Unix socket: no file to go stale; a worker serves only
  its own user's processes, checked with ``SO_PEERCRED``). Where none listens it starts one and waits:
  the first job of a slot costs what a fresh process costs.
- It sends its arguments, working directory and environment (one JSON line) and waits for the job's exit
  status (one JSON line back).

Lifecycle: a worker ends when idle for ``EAGLEDATA_WARM_IDLE_S`` seconds (default 30) with no job holding
its slot (removing the slot's files); after a failed job (nothing of a failure outlives it); after
:data:`~eagledata.tokens.warmworker.MAX_JOBS` jobs; and at once when the job's process ends
before the job does (Snakemake stopping a job ends its process: the worker sees the connection close).
Where a worker cannot be used the job runs in its own process, as it always could, and its log says why:
not Linux; ``EAGLEDATA_WARM_WORKERS=0``; under SLURM (``SLURM_JOB_ID``: a job's allocation ends with it,
and a worker would be killed with the allocation that started it); no private runtime directory; every
slot busy; a worker that did not start or ended during the job; any error in finding one.

Why our own: ``multiprocessing``'s forkserver forks its server, which is unsafe once polars is imported
(it starts threads), and a fork from a process without polars saves only part of a job's start; no
maintained library keeps warm Python processes per key for separate command-line jobs.
"""

from __future__ import annotations

import os
import stat
import sys
import time

# A job's side imports only the C cores of the standard library's json, socket and hashlib where it can:
# those modules, argparse and typing took about 0.017 s of a job's start, more than half of it (the
# interpreter 0.01 s).
# _json's encoder and scanner are the ones json.dumps and json.loads run; _socket is the socket type
# socket.socket wraps; the standard modules are the fallback.
try:
    import _socket as socket
    from _json import encode_basestring_ascii as _json_string, make_scanner as _make_scanner
except ImportError:  # an interpreter without them
    import socket  # type: ignore[no-redef]
    from json.encoder import encode_basestring_ascii as _json_string
    _make_scanner = None
try:
    from _sha2 import sha256  # CPython 3.12 and later
except ImportError:
    try:
        from _sha256 import sha256  # CPython 3.11
    except ImportError:
        from hashlib import sha256

TYPE_CHECKING = False  # (the names are for annotations only)
if TYPE_CHECKING:
    from typing import Any, Mapping, NoReturn, Sequence

#: ``0`` runs every shard job in its own process
ENABLE_ENV = "EAGLEDATA_WARM_WORKERS"
#: how long a job waits for a worker it started to listen
START_TIMEOUT_S = 60.0
#: the arguments of a token_shard job (scripts/token_shard.py)
JOB_FIELDS = ("slice", "stamp", "part", "summary", "log")


# the job's side ----------------------------------------------------------------------------------------

def job_arguments(argv: Sequence[str]) -> dict[str, str]:
    """The job's fields from its command line, ``--FIELD VALUE`` for each of :data:`JOB_FIELDS` (any
    order, each once, no value starting ``--``); anything else prints the usage and exits with status 2
    (as argparse would)."""
    job: dict[str, str] = {}
    args = list(argv)
    while len(args) >= 2 and args[0][2:] in JOB_FIELDS and args[0].startswith("--") and args[0][2:] not in job \
            and not args[1].startswith("--"):
        name, value = args[0][2:], args[1]
        job[name] = value
        del args[:2]
    if args or len(job) != len(JOB_FIELDS):
        usage = " ".join(f"--{name} {name.upper()}" for name in JOB_FIELDS)
        wrong = f"unexpected {args[0]!r}" if args else "missing " + ", ".join(f"--{n}" for n in JOB_FIELDS if n not in job)
        sys.stderr.write(f"usage: token_shard.py {usage}\ntoken_shard.py: error: {wrong}\n")
        sys.exit(2)
    return job


def main(job: Mapping[str, str]) -> NoReturn:
    """Run the token_shard ``job`` (its :data:`JOB_FIELDS`) in a warm worker, or else in this process;
    exit with its status."""
    try:
        code, why = run_in_worker(job)
    except Exception as exc:  # noqa: BLE001 - a worker is an optimisation: the job still runs, here
        code, why = None, f"the warm worker could not be used ({type(exc).__name__}: {exc})"
    if code is not None:
        sys.exit(code)
    run_here(job, why)


def run_in_worker(job: Mapping[str, str]) -> tuple[int | None, str]:
    """(the job's exit status, ""), or (None, why it must run in this process)."""
    why = unavailable()
    directory = None if why else private_dir()
    if directory is None:
        return None, why or "no private runtime directory for the workers' locks"
    key = worker_key(job["stamp"])
    for slot in range(os.cpu_count() or 1):
        lock = os.path.join(directory, f"{key}-{slot}.lock")
        fd = try_lock(lock)
        if fd is None:
            continue
        try:
            return _run_in_slot(worker_address(key, slot), lock, job)
        finally:
            os.close(fd)
    return None, "every worker slot is busy"


def try_lock(lock: str) -> int | None:
    """An exclusive ``flock`` on the file ``lock`` (made where missing), held while the returned
    descriptor is open; None where another process holds it."""
    import fcntl

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def run_here(job: Mapping[str, str], why: str) -> NoReturn:
    """Run the job in this process and exit with its status (without the interpreter's teardown)."""
    from eagledata.io import quick_exit
    from eagledata.tokens.pershard import run_shard_job
    from eagledata.tokens.warmworker import logged_job

    quick_exit(logged_job(job["log"], f"run in its own process: {why}",
                          lambda: run_shard_job(job["slice"], job["stamp"], job["part"], job["summary"])))


def unavailable() -> str:
    """Why no worker may be used here ("" when one may)."""
    if not sys.platform.startswith("linux"):
        return "warm workers need Linux"
    if os.environ.get(ENABLE_ENV, "1").strip() == "0":
        return f"{ENABLE_ENV}=0"
    if os.environ.get("SLURM_JOB_ID"):
        return "under SLURM (a worker would end with the allocation that started it)"
    return ""


def private_dir() -> str | None:
    """This user's directory for the workers' locks and logs (mode 0700, under ``$XDG_RUNTIME_DIR``, else
    ``$TMPDIR``, else /tmp), or None where it cannot be made or is not this user's own."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, f"eagledata-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def worker_key(stamp: str) -> str:
    """The key of the workers that may run a job of ``stamp`` from here (see the module's doc)."""
    import eagledata

    what = [sys.executable, os.environ.get("PYTHONPATH", ""), os.getcwd(), os.path.dirname(eagledata.__file__),
            os.path.abspath(stamp), installed_libraries()]
    return sha256(json_text(what).encode("utf-8")).hexdigest()[:20]


def installed_libraries() -> list[int]:
    """When the interpreter's package directories (``site-packages`` and ``dist-packages`` on ``sys.path``)
    last changed: installing, upgrading or removing a library adds or removes its entries there, so the
    jobs after it go to new workers, not to one holding the libraries it loaded before."""
    times = []
    for entry in sys.path:
        if entry.rstrip(os.sep).endswith(("site-packages", "dist-packages")):
            try:
                times.append(os.stat(entry).st_mtime_ns)
            except OSError:
                pass
    return times


def worker_address(key: str, slot: int) -> str:
    """The name of the abstract socket a slot's worker listens on (:func:`abstract_address` of it)."""
    return f"eagledata-token-shard-{os.getuid()}-{key}-{slot}"


def abstract_address(name: str) -> str:
    """The abstract socket address (Linux: no file) of ``name``."""
    return "\0" + name


def _run_in_slot(address: str, lock: str, job: Mapping[str, str]) -> tuple[int | None, str]:
    conn = _connect(address) or _start_worker(address, lock, job["stamp"])
    if conn is None:
        return None, f"the warm worker did not start (its log: {slot_log(lock)})"
    request = {"job": {k: job[k] for k in JOB_FIELDS}, "cwd": os.getcwd(), "env": dict(os.environ)}
    try:
        conn.sendall(json_text(request).encode("utf-8") + b"\n")
        reply = read_line(conn)
    except OSError:
        reply = b""
    finally:
        conn.close()
    if not reply:
        return None, "the warm worker ended before the job did"
    answer = json_value(reply.decode("utf-8"))
    if answer.get("code") is None:
        return None, f"the warm worker refused the job: {answer.get('refused')}"
    return int(answer["code"]), ""


def _connect(address: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(abstract_address(address))
    except OSError:
        conn.close()
        return None
    return conn


def slot_log(lock: str) -> str:
    """The log file of a slot's worker (what it writes on its own: a failure to start or serve)."""
    return lock.removesuffix(".lock") + ".log"


def _start_worker(address: str, lock: str, stamp: str) -> socket.socket | None:
    import subprocess

    with open(slot_log(lock), "ab") as out:
        # (-c puts the working directory first on sys.path: taken off, so the worker imports what the job does)
        worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.pop(0); import eagledata.tokens.warmworker as w; "
                                   "w.serve_command()", address, lock, os.path.abspath(stamp)],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = _connect(address)
        if conn is not None:
            return conn
        if worker.poll() is not None:  # another job's worker took the address first, or it failed
            return _connect(address)
        time.sleep(0.002)
    return None


def json_text(value: Any) -> str:
    """The JSON text of ``value``: a string, an integer, a list or a dict with string keys of these (what
    a job's request and its workers' key hold), as ``json.dumps`` writes it with compact separators."""
    if isinstance(value, str):
        return _json_string(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{_json_string(k)}:{json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    if type(value) is int:
        return str(value)
    raise TypeError(f"not written by json_text: {type(value).__name__}")


class _Decoding:
    """What json's scanner reads of a decoder: json.loads' defaults."""
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int, parse_constant = float, int, float


def json_value(text: str) -> Any:
    """The value of the JSON text ``text`` (a worker's answer), as ``json.loads`` reads it."""
    if _make_scanner is None:
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(_JSON_SPACE))
    try:
        value, end = _make_scanner(_Decoding())(text, start)
    except StopIteration:
        end = -1
    if end < 0 or text[end:].strip(_JSON_SPACE):
        raise ValueError(f"not one JSON value: {text[:80]!r}")
    return value


_JSON_SPACE = " \t\r\n"


def read_line(conn: socket.socket) -> bytes:
    """Bytes up to the first newline ("" where the peer closed first)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data
