"""GPU pinning for extraction jobs: claim concrete device indices with file locks.

Snakemake's ``resources: gpu=N`` (with ``--resources gpu=8``) only limits how many GPUs the running
jobs may request in total; it assigns no device. Each job therefore claims concrete indices itself:

* one lock file per device, ``{lock_dir}/gpu-{index}.lock``, claimed with a non-blocking
  ``flock(LOCK_EX | LOCK_NB)``;
* a job needing N devices takes all N or none (partial claims are released at once and retried
  after ``poll_s``), so two jobs of 4 on an 8-GPU box never deadlock each other;
* ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so nvidia-smi's indices are CUDA's)
  is set before torch is imported: import this module, call :func:`claim_gpus`, then import torch;
* locks live as long as the open file descriptions: the kernel releases a ``flock`` when the
  process dies, however it dies (``kill -9`` included). Nothing to clean up, no stale lock files.
  The descriptors are opened ``O_CLOEXEC``, so they are not inherited by ``exec``'d children.

Candidate devices: ``CUDA_VISIBLE_DEVICES`` when set (e.g. by SLURM, which then isolates the
job's GPUs anyway), else ``EAGLEDATA_NUM_GPUS`` (a device count, ``0..N-1``: used to simulate
devices on a CPU machine, and to skip nvidia-smi), else ``nvidia-smi``'s indices.
The lock directory is ``EAGLEDATA_GPU_LOCK_DIR`` or ``/tmp/eagledata-gpu-locks``; it must be on a
local filesystem shared by all jobs of one machine (``flock`` over NFS is not reliable).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from eagledata.errors import StageError

log = logging.getLogger("eagledata.extract.gpus")

DEFAULT_LOCK_DIR = "/tmp/eagledata-gpu-locks"


class GpuClaimError(StageError):
    """Not enough free devices within the timeout, or an impossible request."""


def lock_dir_default() -> Path:
    return Path(os.environ.get("EAGLEDATA_GPU_LOCK_DIR") or DEFAULT_LOCK_DIR)


def gpu_candidates(env: dict[str, str] | None = None) -> list[str]:
    """Device indices this process may claim (see module docstring for the order of sources)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    simulated = env.get("EAGLEDATA_NUM_GPUS")
    if simulated not in (None, ""):
        return [str(i) for i in range(int(simulated))]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


class GpuClaim:
    """Devices held by this process. ``ids`` in claim order; :meth:`release` (or process exit)
    frees them. Usable as a context manager."""

    def __init__(self, ids: list[str], fds: list[int], lock_dir: Path):
        self.ids = ids
        self._fds = fds
        self.lock_dir = lock_dir

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # closing the only descriptor of the open file drops the flock
            except OSError:
                pass
        self._fds = []

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def __enter__(self) -> "GpuClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"GpuClaim(ids={self.ids}, held={self.held}, lock_dir={str(self.lock_dir)!r})"


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def try_claim(n: int, candidates: Iterable[str], lock_dir: str | Path) -> GpuClaim | None:
    """One non-blocking attempt: all ``n`` devices or ``None`` (nothing held afterwards)."""
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    fds: list[int] = []
    for g in candidates:
        fd = _try_lock(lock_dir / f"gpu-{g}.lock")
        if fd is None:
            continue
        ids.append(g)
        fds.append(fd)
        if len(ids) == n:
            return GpuClaim(ids, fds, lock_dir)
    for fd in fds:
        os.close(fd)
    return None


#: Claims made by :func:`claim_gpus` stay referenced here for the life of the process.
_HELD: list[GpuClaim] = []


def claim_gpus(n: int, lock_dir: str | Path | None = None, timeout_s: float = 24 * 3600, poll_s: float = 2.0,
               candidates: Iterable[str] | None = None, set_env: bool = True) -> list[str]:
    """Claim ``n`` devices for the rest of this process's life and (``set_env``) point
    ``CUDA_VISIBLE_DEVICES`` at them. Returns the claimed indices; ``[]`` when ``n <= 0`` or no
    device is visible (CPU machine). Waits up to ``timeout_s`` for busy devices, then raises
    :class:`GpuClaimError`. Call before importing torch."""
    cands = list(candidates) if candidates is not None else gpu_candidates()
    if n <= 0 or not cands:
        return []
    if n > len(cands):
        raise GpuClaimError(f"{n} GPUs requested per job, only {len(cands)} visible: {cands}")
    lock_dir = Path(lock_dir) if lock_dir is not None else lock_dir_default()
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        claim = try_claim(n, cands, lock_dir)
        if claim is not None:
            _HELD.append(claim)
            if set_env:
                os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claim.ids)
            log.info("claimed GPUs %s (locks in %s)", claim.ids, lock_dir)
            return claim.ids
        if time.monotonic() >= deadline:
            raise GpuClaimError(
                f"could not claim {n} free GPUs of {cands} within {timeout_s} s (locks in {lock_dir}); "
                f"is another job holding them, or is --resources gpu larger than the machine's GPU count?")
        if not waited:
            log.info("all of %s busy or too few free for %d; waiting (locks in %s)", cands, n, lock_dir)
            waited = True
        time.sleep(poll_s)


def release_all() -> None:
    """Release every claim made by :func:`claim_gpus` in this process (tests; normal jobs just exit)."""
    while _HELD:
        _HELD.pop().release()


def held_by_others(lock_dir: str | Path, candidates: Iterable[str]) -> list[str]:
    """Indices whose lock is currently held by some other open file (diagnostics)."""
    busy = []
    for g in candidates:
        fd = _try_lock(Path(lock_dir) / f"gpu-{g}.lock")
        if fd is None:
            busy.append(g)
        else:
            os.close(fd)
    return busy


def main(argv: list[str] | None = None) -> int:
    """``python -m eagledata.extract.gpus N [--lock-dir D] -- CMD ...``: claim N devices, then run CMD
    with ``CUDA_VISIBLE_DEVICES`` set (the locks are held by this process until CMD exits)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagledata.extract.gpus", description=main.__doc__)
    p.add_argument("n", type=int)
    p.add_argument("--lock-dir", default=None)
    p.add_argument("--timeout", type=float, default=24 * 3600)
    argv = list(sys.argv[1:] if argv is None else argv)
    # the command is everything after the first "--" (argparse's REMAINDER would swallow the options
    # after N as the command)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    ids = claim_gpus(a.n, a.lock_dir, timeout_s=a.timeout)
    cmd = argv[cut + 1:]
    if not cmd:
        print(",".join(ids))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
