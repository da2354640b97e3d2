"""Rescue files: paid answers that could not be written to the response cache (a full disk).

When a cache write fails, the answers received from then on are kept in memory and appended (one
``write`` + ``fsync`` each) to a rescue file, preferably on another filesystem than the cache:
``$EAGLEDATA_RESCUE_DIR`` when set, else ``{work dir}/.eagledata-rescue/``, else
``$TMPDIR/eagledata-rescue/``, those on another device than the cache tried first. The file holds
exact cache lines; its name ties it to one cache file (``{dataset}-{sha of the cache path}-{pid}-{time}.jsonl``),
so the next job of that dataset run from the same work directory or on the same host
(``$TMPDIR``) imports it into the cache before it sends anything, then deletes it. A job that can
write its answers to the cache after all (space came back in time) deletes its rescue file itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

RESCUE_ENV = "EAGLEDATA_RESCUE_DIR"
WORKDIR_RESCUE = ".eagledata-rescue"


def free_space(path: str | Path) -> str:
    """Free space on the filesystem holding ``path`` (its nearest existing parent), for messages."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError as exc:
        return f"free space unknown ({exc.strerror or exc})"
    return f"{free:,} bytes free on its filesystem"


def _device(path: Path) -> int | None:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.stat(p).st_dev
    except OSError:
        return None


def rescue_dirs(cache_path: str | Path) -> list[Path]:
    """Where rescue files go (and are looked for), those on another device than the cache first."""
    dirs = [Path(os.environ[RESCUE_ENV])] if os.environ.get(RESCUE_ENV) else []
    dirs += [Path.cwd() / WORKDIR_RESCUE, Path(tempfile.gettempdir()) / "eagledata-rescue"]
    cache_dev = _device(Path(cache_path).parent)
    unique = list(dict.fromkeys(d.absolute() for d in dirs))
    return sorted(unique, key=lambda d: _device(d) == cache_dev)  # stable: other devices first


def cache_tag(cache_path: str | Path, dataset: str) -> str:
    """The rescue-file name part of a cache: the dataset and a hash of the cache's absolute path."""
    digest = hashlib.sha256(str(Path(cache_path).absolute()).encode("utf-8")).hexdigest()[:12]
    return f"{dataset}-{digest}"


def find_rescue_files(cache_path: str | Path, dataset: str) -> list[Path]:
    """Rescue files of this cache file, oldest first."""
    tag = cache_tag(cache_path, dataset)
    found = {f for d in rescue_dirs(cache_path) if d.is_dir() for f in d.glob(f"{tag}-*.jsonl")}
    return sorted(found, key=lambda f: (f.stat().st_mtime, f.name))


def read_rescue_lines(path: Path) -> Iterator[bytes]:
    """The complete lines of a rescue file (a torn last line, from a job killed mid-write, is left out)."""
    with open(path, "rb") as fh:
        for line in fh:
            if line.endswith(b"\n") and line.strip():
                yield line


class RescueFile:
    """One job's rescue file, created at the first line it must hold."""

    def __init__(self, cache_path: str | Path, dataset: str):
        self.cache_path, self.dataset = Path(cache_path), dataset
        self.path: Path | None = None
        self.fd: int | None = None
        self.errors: list[str] = []  # "path: error" of every place that refused it

    def _open(self) -> int:
        name = f"{cache_tag(self.cache_path, self.dataset)}-{os.getpid()}-{int(time.time())}.jsonl"
        self.errors = []
        for d in rescue_dirs(self.cache_path):
            try:
                d.mkdir(parents=True, exist_ok=True)
                fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as exc:
                self.errors.append(f"{d}: {exc.strerror or exc} ({free_space(d)})")
                continue
            self.path, self.fd = d / name, fd
            return fd
        raise OSError(f"no rescue directory is writable: {'; '.join(self.errors)}")

    def append(self, lines: Iterable[bytes]) -> None:
        """Append and ``fsync``; raises ``OSError`` when no rescue directory can take them (the
        file is then cut back, so that a retry starts on a clean line)."""
        data = b"".join(lines)
        if not data:
            return
        fd = self.fd if self.fd is not None else self._open()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            self.errors.append(f"{self.path}: {exc.strerror or exc} ({free_space(self.path)})")
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise

    def discard(self) -> None:
        """Every line is in the cache now: delete the file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
