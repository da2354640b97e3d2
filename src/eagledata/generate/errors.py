"""The generate stage's errors (a module of their own, so that every other module of the package can
raise them without importing the job)."""

from __future__ import annotations

from eagledata.errors import StageError


class GenerationError(StageError):
    """The generation job cannot finish; the message says what to do. The cache is kept."""


class JobStopped(GenerationError):
    """A condition that stops every request (401, 402, budget, a failed cache or ledger write)."""


class Interrupted(GenerationError):
    """SIGINT/SIGTERM or the job timeout: in-flight requests were drained, the cache is consistent.
    :attr:`exit_code` is ``128 + signal`` (1 for the job timeout)."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 1
