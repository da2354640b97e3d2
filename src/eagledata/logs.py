"""A job's log file for the thin Snakemake entry scripts: one line per message, flushed at once,
so a killed job's log is complete up to the kill."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def line_log(path: str) -> Iterator[Callable[[str], None]]:
    with open(path, "a", encoding="utf-8") as fh:

        def log(message: str) -> None:
            fh.write(message + "\n")
            fh.flush()

        yield log
