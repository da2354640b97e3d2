"""``eagledata retry``: request final errors again.

A final error (a 4xx other than 401, 402, 408 and 429: say 404 "No endpoints found matching your data
policy", or 400 for a model id the provider did not know yet) is cached like an answer, so a rerun
does not send its request again: the same request would get the same answer. When the cause was a
setting outside the request (the account's data policy, a provider's outage answered with a 4xx, a
model not yet released), the user fixes it and runs ``eagledata retry``: every final error of the
chosen datasets (of the chosen statuses) is forgotten, and the next ``snakemake`` run requests them
again, and only them.

Nothing is removed from the cache (it stays append-only): a retry marker is appended per error
(:meth:`~eagledata.generate.cache.ResponseCache.forget`; an answer, status 200, is never forgotten),
under the dataset's cache writer lock (a generate job writing that cache now makes the command refuse
that dataset, changing nothing), after a retry note, ``{cache_dir}/{dataset}/retry.json``. The generate rule declares the note as an input where it exists
(:meth:`~eagledata.generate.ruleinputs.GenerateRuleInputs.retried`): newer than the job's outputs, it
makes Snakemake rerun the job (``snakemake -n`` shows it), which sends the forgotten requests (a
final error costs nothing; they are counted in ``eagledata plan`` again).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from eagledata.generate.errors import GenerationError
from eagledata.generate.rescue import free_space
from eagledata.io import atomic_write_json

# the cache and its lock are imported where used: the generate rule's input function imports this
# module while the workflow is parsed (retry_note_path), and every dry run pays for what it imports

RETRY_NOTE = "retry.json"
#: The config ``eagledata`` commands read by default (their ``--config``), where they are run.
DEFAULT_CONFIG = "config/config.yaml"


def retry_note_path(cache_dir: str | Path, dataset: str) -> Path:
    """Where :func:`retry_final_errors` writes a dataset's retry note."""
    return Path(cache_dir) / dataset / RETRY_NOTE


def final_errors(cache: Any, statuses: Iterable[int] | None = None, keys: Iterable[str] | None = None) -> dict[str, int]:
    """The keys of ``cache`` (a loaded :class:`~eagledata.generate.cache.ResponseCache`; of ``keys`` when
    given) whose record is a final error, of ``statuses`` when given -> the record's status."""
    wanted = set(statuses) if statuses else None
    out: dict[str, int] = {}
    errors = cache.not_answered if keys is None else cache.not_answered.intersection(keys)
    if not errors:
        return out
    with open(cache.path, "rb") as fh:
        for key in sorted(errors):
            if key in cache.index and key not in cache.aliases:
                status = cache.get(key, fh).get("status")
                if wanted is None or status in wanted:
                    out[key] = status
    return out


def retry_final_errors(cache_dir: str | Path, dataset: str, statuses: Iterable[int] | None = None,
                       dry_run: bool = False) -> dict[str, int]:
    """Forget the final errors of ``dataset``'s cache (of ``statuses`` when given) and write its retry
    note; returns how many per status. ``dry_run``: count them, change nothing. Raises
    :class:`RetryRefused` while a job holds the dataset's cache lock (nothing is changed then), and
    :class:`RetryFailed` when a write fails. The note is written before the first marker: a final
    error forgotten without the note would not be requested until something else reran the job (a
    second ``eagledata retry`` finds it forgotten already), a note without markers reruns it for nothing."""
    from eagledata.generate.cache import ResponseCache
    from eagledata.generate.cachelock import describe_holder, lock_path, try_writer_lock

    path = Path(cache_dir) / dataset / "responses.jsonl"
    if not path.exists():
        return {}
    try:
        lock = try_writer_lock(cache_dir, dataset)
    except OSError as exc:
        raise RetryFailed(f"dataset {dataset!r}: {lock_path(cache_dir, dataset)}: {exc.strerror or exc}; "
                          "nothing was forgotten") from None
    if lock is None:
        raise RetryRefused(f"dataset {dataset!r}: a generate job is writing its cache now "
                           f"({describe_holder(lock_path(cache_dir, dataset))}); run eagledata retry when it has finished")
    with lock:
        cache = ResponseCache(path)
        cache.load()
        found = final_errors(cache, statuses)
        counts = status_counts(found)
        if dry_run or not found:
            return counts
        note = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "by": "eagledata retry"}
        _forget_all(cache, dataset, found, note, retry_note_path(cache_dir, dataset), counts)
    return counts


def _forget_all(cache: Any, dataset: str, found: Mapping[str, int], note: Mapping[str, Any],
                note_path: Path, counts: Mapping[str, int]) -> None:
    """The note, then a marker per key of ``found`` (durable once this returns); a failed write is a
    :class:`RetryFailed` saying how many were forgotten."""
    try:
        atomic_write_json(note_path, {**note, "forgotten": counts})
    except OSError as exc:
        raise RetryFailed(f"dataset {dataset!r}: {note_path}: {exc.strerror or exc} ({free_space(note_path)}); "
                          "nothing was forgotten") from None
    done, problem = 0, None
    try:
        for key, status in found.items():
            cache.forget(key, {**note, "status": status})
            done += 1
    except OSError as exc:
        problem = f"{cache.path}: {exc.strerror or exc} ({free_space(cache.path)})"
    finally:
        cache.close()
    if cache.write_error is not None:  # an fsync failed: the markers it covered are cut off the file again
        done, problem = done - len(cache.pending), problem or cache.write_error
    if problem is not None:
        raise RetryFailed(f"dataset {dataset!r}: {done} of {len(found)} final error(s) forgotten, then {problem}; "
                          f"those are requested by the next run ({note_path} is written): free space and run "
                          f"eagledata retry {dataset} again for the rest")


class RetryRefused(GenerationError):
    """A dataset's cache is being written by a generate job: nothing was changed."""


class RetryFailed(GenerationError):
    """A write of ``eagledata retry`` failed (a full disk); the message says what was forgotten."""


def cmd_retry(args: Any) -> int:
    """``eagledata retry [DATASET...] [--status N ...] [--dry-run]``: see the module docstring."""
    from eagledata.config import ConfigError, dataset_settings, load_config

    try:
        config = load_config(args.config)
        settings = {d: dataset_settings(config, d) for d in (args.datasets or config["datasets"])}
    except (ConfigError, OSError) as exc:
        print(f"eagledata retry: {exc}", file=sys.stderr)
        return 2
    imported = [d for d, s in settings.items() if s.imported]
    if args.datasets and imported:
        print(f"eagledata retry: {', '.join(imported)}: imported, not generated: nothing to request", file=sys.stderr)
        return 2
    refused = 0
    for dataset in (d for d, s in settings.items() if not s.imported):
        try:
            counts = retry_final_errors(config["cache_dir"], dataset, args.status, args.dry_run)
        except (RetryRefused, RetryFailed) as exc:
            print(f"eagledata retry: {exc}", file=sys.stderr)
            refused += 1
            continue
        print(describe(dataset, counts, args.dry_run))
    return 1 if refused else 0


def retry_command(dataset: str, status: int | str | None = None) -> str:
    """The ``eagledata retry`` command a message suggests for ``dataset`` (and ``status``), with
    ``--config FILE`` when the Snakemake run read one config file other than the default (the workflow
    sets ``EAGLEDATA_CONFIGFILES`` to the files it read in every process that parses it): without it
    the command would read the default config, which may not name the dataset, or names another cache."""
    try:
        files = json.loads(os.environ.get("EAGLEDATA_CONFIGFILES") or "[]")
    except ValueError:
        files = []
    config = config_option(files[0]) if len(files) == 1 else ""
    return f"eagledata retry {dataset}{config}" + (f" --status {status}" if status is not None else "")


def config_option(config_path: str | None) -> str:
    """`` --config FILE`` for a suggested command to read ``config_path``; empty for none, or for the
    default config (:data:`DEFAULT_CONFIG`, which the command reads where it is run: where Snakemake ran)."""
    if not config_path or Path(config_path).resolve() == Path(DEFAULT_CONFIG).resolve():
        return ""
    return f" --config {config_path}"


def status_counts(found: Mapping[str, int]) -> dict[str, int]:
    """HTTP status (as text) -> how many of ``found`` (:func:`final_errors`) have it, in status order."""
    return dict(sorted(Counter(str(s) for s in found.values()).items()))


def describe(dataset: str, counts: Mapping[str, int], dry_run: bool) -> str:
    """One line per dataset: how many final errors are (or would be) requested again, by status."""
    n = sum(counts.values())
    if not n:
        return f"{dataset}: no final error cached"
    by = ", ".join(f"HTTP {s}: {c}" for s, c in counts.items())
    if dry_run:
        return f"{dataset}: {n} final error(s) would be requested again ({by})"
    return (f"{dataset}: {n} final error(s) forgotten ({by}); the next snakemake run requests them again "
            f"(snakemake -n shows the generate job of {dataset})")
