"""One exception hierarchy: every error the pipeline raises on purpose derives from
:class:`EagledataError`, so a caller can catch them all (the CLI and the rule scripts do, and print
the message alone); each stage's errors keep their standard base too (``ValueError`` for bad input,
``RuntimeError`` for a failed job) so existing ``except`` clauses still hold.

Errors a stage can continue past are values, not exceptions (a response that fails a check is a
verdict with reasons); these are for the cases where continuing would corrupt data or waste money.
"""

from __future__ import annotations


class EagledataError(Exception):
    """Base of every eagledata error."""


class InputError(EagledataError, ValueError):
    """Bad user input (a config, a prompt file, a responses file); the message names file, line, field."""


class StageError(EagledataError, RuntimeError):
    """A stage could not complete (nothing it already finished is lost)."""
