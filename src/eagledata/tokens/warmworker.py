"""The worker's side of :mod:`eagledata.tokens.warmjobs` (read its doc first): a slot's worker process
(:func:`serve`, started by a job as ``serve_command``), and the logging every token_shard job runs under,
in a worker or in its own process (:func:`logged_job`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import sys
import threading
from typing import Any, Callable, Iterator, Mapping, NoReturn

from eagledata.tokens.warmjobs import abstract_address, read_line, slot_log, try_lock

log = logging.getLogger(__name__)

#: seconds a worker waits for its next job before it ends
IDLE_ENV = "EAGLEDATA_WARM_IDLE_S"
DEFAULT_IDLE_S = 30.0
#: jobs a worker runs before it ends (what Python's allocator keeps between jobs is given back)
MAX_JOBS = 64
#: a worker whose job's process ended first ends with this status
EXIT_CLIENT_GONE = 75
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def logged_job(log_path: str, first_line: str, run: Callable[[], Any]) -> int:
    """``run()`` with the job's log file as the root logger's handler (INFO and up; ``first_line`` first):
    0, or 1 with the exception logged."""
    with job_logging(log_path):
        log.info("%s", first_line)
        try:
            run()
        except Exception:
            log.exception("token_shard failed")
            return 1
    return 0


@contextlib.contextmanager
def job_logging(path: str) -> Iterator[None]:
    """The job's log file as the root logger's handler (INFO and up) while the job runs."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def serve(address: str, lock: str, stamp: str, idle_s: float) -> None:
    """A slot's worker: listen on ``address``, load the stage and the ``stamp``'s tokenizer once, run jobs
    until idle for ``idle_s`` seconds with the slot's ``lock`` free, until a job fails, or :data:`MAX_JOBS` jobs."""
    import select

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(abstract_address(address))
    except OSError:
        return  # the slot has its worker already
    listener.listen(4)
    slot = address.rsplit("-", 1)[1]
    from eagledata.codeinputs import stamp_settings
    from eagledata.config import tokenizer_from_settings
    from eagledata.tokens.pershard import run_shard_job

    loaded = tokenizer_from_settings(stamp_settings(stamp))
    jobs = 0
    while True:
        code = 0
        if not select.select([listener], [], [], idle_s)[0]:
            if try_lock(lock) is not None:  # no job holds or waits for the slot: end (holding it), leave nothing
                _remove_slot_files(lock)
                return
            continue
        conn, _ = listener.accept()
        with conn:
            if _peer_uid(conn) != os.getuid():
                continue
            request = json.loads(read_line(conn) or b"null")
            if not isinstance(request, dict):
                continue
            job = request["job"]
            if os.path.abspath(os.path.join(request["cwd"], job["stamp"])) != stamp:
                conn.sendall(json.dumps({"code": None, "refused": f"its stamp is not {stamp}"}).encode() + b"\n")
                continue
            jobs += 1
            code = _run_job(conn, request, lambda: run_shard_job(job["slice"], job["stamp"], job["part"],
                                                                 job["summary"], loaded), f"slot {slot}, its job {jobs}")
            conn.sendall(json.dumps({"code": code}).encode("utf-8") + b"\n")
            conn.shutdown(socket.SHUT_RDWR)
        if code != 0 or jobs >= MAX_JOBS:
            return


def _run_job(conn: socket.socket, request: Mapping[str, Any], run: Callable[[], Any], which: str) -> int:
    done = threading.Event()
    threading.Thread(target=_end_with_the_job, args=(conn, done), daemon=True).start()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _restart_peak_memory()
    code = logged_job(request["job"]["log"], f"run in warm worker {os.getpid()} ({which})", run)
    done.set()
    return code


def _end_with_the_job(conn: socket.socket, done: threading.Event) -> None:
    """End this worker at once when the job's process ends before its job does."""
    with contextlib.suppress(OSError):
        conn.recv(1)  # the job's process sends nothing more: this returns when it closes
    if not done.is_set():
        os._exit(EXIT_CLIENT_GONE)


def _restart_peak_memory() -> None:
    """Linux: reset this process's peak resident memory (``VmHWM``) to what it holds now."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")


def _remove_slot_files(lock: str) -> None:
    """The slot's lock file, and its log where empty: a job that opened the lock before it is removed
    and one that makes it anew may both reach the slot's address; the second waits for the first's job."""
    with contextlib.suppress(OSError):
        os.unlink(lock)
        if os.path.getsize(slot_log(lock)) == 0:
            os.unlink(slot_log(lock))


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def idle_seconds() -> float:
    """``EAGLEDATA_WARM_IDLE_S`` (default 30)."""
    try:
        return max(0.1, float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S)))
    except ValueError:
        return DEFAULT_IDLE_S


def serve_command() -> NoReturn:
    """The worker process's entry: ``serve(address, lock, stamp)`` from its command line."""
    try:
        serve(sys.argv[1], sys.argv[2], sys.argv[3], idle_seconds())
    except Exception:
        log.exception("the warm worker failed")
        logging.shutdown()
        os._exit(1)
    os._exit(0)
