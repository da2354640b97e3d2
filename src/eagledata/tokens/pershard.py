"""The tokens stage as one job per shard (the Snakemake rules of rules/tokens.smk), with the same
samples, verdicts and shard files as :func:`eagledata.tokens.shards.build_token_shards`.

Steps under ``results/{dataset}/tokens.work/``, in three jobs: the plan, one reconstruction per
shard, and steps 3-5 together (:func:`learn_and_judge`, the ``tokens`` rule):

1. :func:`~eagledata.tokens.plan.plan_shards` (a checkpoint; no polars in its job): streams the responses' ids
   (every record checked, as the one-job stage checks them), cuts them by the stable rule
   (:func:`~eagledata.tokens.shards.shard_groups`) and writes ``plan.json`` (shard key -> rows, first and last
   id; ``source_lines_xxh3_128``, a digest of the file's records as it holds them
   (:class:`~eagledata.tokens.planscan.RecordScan`), and ``source_records_sha256``, the sha256 of the slices
   concatenated in plan order: the records in id order, so a reorder of the lines changes the one, not the
   other, and the manifest records the other) and, per shard, a *slice*, ``slices/{key}.tsv`` (what the shard
   holds, id order: ``json(id) TAB digest of the record's line``, :func:`~eagledata.io.line_digest`) and where
   its records are, ``where/{key}.tsv`` (``byte offset TAB length TAB line number`` in the responses file).
   The records are not copied: a slice is about 100 bytes a sample whatever the responses' size. A slice whose
   bytes did not change is left untouched (same bytes, same mtime), so the shard's jobs do not rerun when
   records move in the file or others change; the slices are not a Snakemake output for the same reason as
   ``tokens.store`` (a rerun would delete them). A shard's **key** is the first 16 hex of the sha256 of its
   first id: stable while that shard's first id is, and the same key extraction jobs can follow later.
2. :func:`reconstruct_shard` (per shard, the heavy one): the slice's records, read from the responses
   at their offsets and checked against the slice's digests -> ``parts/{key}.parquet``
   (ids and everything verdicts are computed from) + ``parts/{key}.summary.json`` (a few hundred bytes
   of counters: :mod:`eagledata.tokens.summaries`).
3. :func:`learn_summaries`: the summaries only -> ``learned.json`` (count conventions,
   reasoning-count reliability, prompt variants). Each summary records the fingerprint of the
   tokenizer its shard was reconstructed with; a shard of another tokenizer than the dataset's is
   refused (:func:`refuse_stale_parts`), never gathered.
4. :func:`learn_repairs`: which repair each provider is proven to apply (round 1 of the repair
   search) over the samples that need one, one shard's part at a time -> ``conventions.json``.
5. :func:`judge_and_gather` (cheap per shard): each shard's verdicts, repairs and policy
   column under the learned conventions (:func:`judge_shard`, one part in memory at a time) -> the
   final shard, content-named, in ``tokens.store`` (left untouched when its content exists already),
   then ``tokens/manifest.json`` and hard links, as the one-job stage. Judging is a few hundredths of
   a second per shard, less than a job's start (about a second), so steps 3-5 are one job rather than
   one per shard: the per-shard judge jobs this replaced cost half of the stage's time.

No job holds more than one shard's samples, and none holds a dataset-sized structure: the plan sorts the ids
in runs of :data:`~eagledata.tokens.plan.RUN_ROWS` on disk and merges them, learning holds counters, and the
per-shard steps turn :data:`BATCH_ROWS` rows at a time into Python objects. A new response rewrites one slice
(two when it starts a shard), so one reconstruction job reruns, then the dataset's learning and judging jobs
(a shard whose verdicts did not change keeps its file, so nothing downstream of it reruns).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import polars as pl

if TYPE_CHECKING:
    from concurrent.futures import Executor

from eagledata.codeinputs import stamp_settings, verify_inherited_code, verify_loaded_code
from eagledata.config import tokenizer_from_settings
from eagledata.errors import StageError
from eagledata.io import atomic_path, atomic_write_json, line_digest, loads_json, replace_unless_same, sha256_file
from eagledata.text.families import ModelFamily
from eagledata.text.tokenizer import Tokenizer
from eagledata.tokens.memory import peak_memory_mb
from eagledata.tokens.sharedwork import shared_map, spawned_pool
from eagledata.tokens import summaries
from eagledata.tokens.planfile import PLAN_VERSION, plan_keys, read_plan
from eagledata.tokens.checks import SampleStats
from eagledata.tokens.chunk_templates import native_stream_reading
from eagledata.tokens.policy import resolve_policy
from eagledata.tokens.responses import ParsedResponse
from eagledata.tokens.samples import parse_record
from eagledata.tokens.sharding import SHARDING_RULE, checked_record, shard_key  # (shard_key: named here by eagledata.extract.plan)
from eagledata.tokens.shards import (PASS1_SCHEMA, Judge, ResponsesFileError,
                                     Learned, proven_repairs, prune_shards, publish_shard, reconstruct_sample, transformations_seen, VerdictColumns,
                                     shard_name, few_distinct_lists)

log = logging.getLogger(__name__)
#: Columns a part carries beyond the final shard's first columns (dropped when judged).
_STATS_SCHEMA: Mapping[str, Any] = {"has_eot": pl.Boolean, "codes": pl.List(pl.Utf8), "has_tools": pl.Boolean,
                                    "prompt_alt": pl.Utf8}
#: A part's columns: the final shard's first columns and the stats, the ids as 32-bit integers (a
#: third less to write and read back; the final shard's ``input_ids`` are cast back to 64-bit once its
#: judged chunks are gathered, :func:`judge_shard`: its bytes are the same; an id past 32 bits is refused
#: when the part is built, never wrapped).
PART_SCHEMA: Mapping[str, Any] = {**PASS1_SCHEMA, "input_ids": pl.List(pl.Int32), **_STATS_SCHEMA}


def work_paths(work_dir: str | Path, key: str) -> dict[str, Path]:
    w = Path(work_dir)
    return {"slice": w / "slices" / f"{key}.tsv", "where": w / "where" / f"{key}.tsv", "part": w / "parts" / f"{key}.parquet",
            "summary": w / "parts" / f"{key}.summary.json"}


# 1. a shard's slice ---------------------------------------------------------------------------

def slice_sources(slice_path: str | Path) -> tuple[Path, str]:
    """Where a slice's records are: its ``where/`` file and the responses file its plan read (the
    ``source`` of ``plan.json`` beside ``slices/``). Derived, not declared: a rule param per shard
    job costs the dry run about half a millisecond per shard."""
    slice_path = Path(slice_path)
    work = slice_path.parent.parent
    plan = read_plan(work / "plan.json")
    if plan.get("version") != PLAN_VERSION:
        raise ResponsesFileError(f"{work / 'plan.json'}: a plan of version {plan.get('version')!r}, this eagledata reads "
                                 f"version {PLAN_VERSION}: rerun token_plan (snakemake -R token_plan)")
    return work_paths(work, slice_path.stem)["where"], plan["source"]


def iter_slice(slice_path: str | Path, where_path: str | Path,
               responses_path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(id, record) of every sample of a slice, in id order: each record's line read from the
    responses at its offset (``where_path``) and refused unless its digest is the slice's (the
    responses changed after the plan: rerun it)."""
    with open(slice_path, "rb") as ids, open(where_path, "rb") as at, open(responses_path, "rb") as src:
        for n, (entry, place) in enumerate(itertools.zip_longest(ids, at), 1):
            if entry is None or place is None:
                raise ResponsesFileError(f"{slice_path}: {where_path} does not list its records (line {n}): rerun token_plan")
            sid_json, _, digest = entry.rstrip(b"\n").partition(b"\t")
            offset, length, lineno = (int(x) for x in place.split(b"\t"))
            src.seek(offset)
            line = src.read(length)
            if line_digest(line).encode("ascii") != digest:
                raise ResponsesFileError(f"{responses_path}:{lineno}: not the record token_plan saw there "
                                         f"(id {loads_json(sid_json)!r}): the responses changed after the plan; rerun token_plan")
            yield loads_json(sid_json), checked_record(loads_json(line), f"{responses_path}:{lineno}")


# 2. reconstruction ---------------------------------------------------------------------------------

#: Rows a per-shard job holds as Python objects at a time: a job's memory follows this, not the size of
#: its shard (a shard's columns are held compactly, in polars, between batches).
BATCH_ROWS = 256


def reconstruct_shard(slice_path: str | Path, where_path: str | Path, responses_path: str | Path,
                      part_path: str | Path, summary_path: str | Path, tokenizer: Tokenizer, family: ModelFamily,
                      template: str | None = None) -> dict[str, Any]:
    """One shard's samples (its slice, see :func:`iter_slice`) -> its part and summary; returns the summary."""
    if not native_stream_reading():
        log.info("streams read in Python only: the compiled core (eagledata/tokens/chunkscan.c) is not built from "
                 "this source; reinstall (pip install -e .) where a C compiler is found (same results, slower)")
    frames: list[pl.DataFrame] = []
    stats = []
    clock = PhaseClock()
    with collected_per_batch() as collect:
        for batch in _parsed_batches(iter_slice(slice_path, where_path, responses_path)):
            clock.tick("records read and parsed")
            tokenizer.encode_plain_ahead(_answer_texts(batch))
            clock.tick("answers encoded")
            columns: dict[str, list] = {name: [] for name in PART_SCHEMA}  # built column-wise: one Series each
            for sid, rec, parsed in batch:
                st, row = reconstruct_sample(rec, sid, tokenizer, family, template, parsed)
                row.update(has_eot=st.has_eot, codes=st.codes, has_tools=st.has_tools,
                           prompt_alt=json.dumps(st.prompt_alt) if st.prompt_alt is not None else None)
                for name, values in columns.items():
                    values.append(row[name])
                stats.append(st)
            clock.tick("samples built and checked")
            # (the flags and codes: few distinct lists, each made once)
            frames.append(pl.DataFrame({**columns, "flags": few_distinct_lists("flags", columns["flags"]),
                                        "codes": few_distinct_lists("codes", columns["codes"])}, schema=PART_SCHEMA))
            del batch, columns
            collect()
            clock.tick("part")
    clock.tick("records read and parsed")
    tokenizer.encode_plain_ahead(())  # nothing left over held
    if not frames:
        frames.append(pl.DataFrame({name: [] for name in PART_SCHEMA}, schema=PART_SCHEMA))
    # the tokenizer as loaded: the dataset job refuses to gather parts reconstructed with another
    summary = {**summaries.summarize(stats), "tokenizer_fingerprint": tokenizer.fingerprint}
    Path(part_path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(part_path) as tmp:
        pl.concat(frames).write_parquet(tmp, compression="zstd")
    Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(summary_path, summary)
    clock.tick("part")
    log.info("shard %s: %d samples in %s", Path(slice_path).stem, len(stats), clock)
    return summary


def run_shard_job(slice_path: str | Path, stamp: str | Path, part_path: str | Path, summary_path: str | Path,
                  loaded: tuple[Tokenizer, ModelFamily] | None = None) -> dict[str, Any]:
    """The ``token_shard`` job: its slice -> its part and summary, with the tokenizer its stage ``stamp``
    names (``loaded``: that tokenizer and family, where the caller holds them: a warm worker,
    :mod:`eagledata.tokens.warmjobs`). The code it runs is checked against the stamp before and after."""
    verify_loaded_code([stamp])
    tokenizer, family = loaded or tokenizer_from_settings(stamp_settings(stamp))
    where, responses = slice_sources(slice_path)
    summary = reconstruct_shard(slice_path, where, responses, part_path, summary_path, tokenizer, family)
    log.info("peak memory %.0f MB", peak_memory_mb())
    verify_loaded_code([stamp])
    return summary


class PhaseClock:
    """Where a job's time goes, for its log: :meth:`tick` adds the time since the previous tick (or since
    the clock was made) to a phase; ``str()`` is ``"T s: phase t, ..."`` in the order phases first came."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.spent: dict[str, float] = {}

    def tick(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] = self.spent.get(phase, 0.0) + now - self.last
        self.last = now

    def __str__(self) -> str:
        return f"{self.last - self.start:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in self.spent.items())


def _parsed_batches(records: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[list[tuple[str, dict[str, Any], ParsedResponse]]]:
    """``(id, record, parsed response)`` in batches of :data:`BATCH_ROWS`: a batch's bodies are all
    parsed before any of its samples is encoded (each record kept without its body). Encoding one
    sample's texts between two parses ran about a quarter slower than encoding a batch's in a row:
    the parses evict what the tokenizer keeps warm in the CPU's caches."""
    batch: list[tuple[str, dict[str, Any], ParsedResponse]] = []
    for sid, rec in records:
        parsed = parse_record(rec)
        batch.append((sid, {k: v for k, v in rec.items() if k != "response_raw"}, parsed))
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _answer_texts(batch: Sequence[tuple[str, dict[str, Any], ParsedResponse]]) -> Iterator[str]:
    """The texts of a batch's answers that their reconstruction encodes as they are: reasoning, content,
    each tool call's arguments (a text a reconstruction changes first is encoded when it is asked for)."""
    for _, _, parsed in batch:
        for text in (parsed.reasoning, parsed.content):
            if text:
                yield text
        for call in parsed.tool_calls:
            if call.arguments:
                yield call.arguments


@contextlib.contextmanager
def collected_per_batch() -> Iterator[Callable[[], int]]:
    """Python's cyclic garbage collector paused inside, run when the caller calls what this yields (once
    per batch), and never again over what was alive on entry (the modules, the tokenizer: frozen).
    Its automatic runs walked the id lists a batch builds (millions of items) again and again: about
    a twentieth of a drafter-sized shard's job. Cycles are still collected once a batch, so a job's
    memory does not grow with its shard."""
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield gc.collect
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


def part_stats(df: pl.DataFrame) -> list[SampleStats]:
    """The :class:`SampleStats` of a part's rows."""
    cols = ["id", "provider", "finish_reason", "prompt_len", "completion_len", "reasoning_len", "has_eot",
            "billed_prompt", "billed_completion", "billed_reasoning", "codes", "has_tools", "prompt_alt"]
    out = []
    # (column by column: a select's rows cost about three times as much)
    for *head, codes, has_tools, alt in zip(*[df.get_column(c).to_list() for c in cols]):
        out.append(SampleStats(*head, codes=codes, has_tools=has_tools,
                               prompt_alt=loads_json(alt) if alt is not None else None))
    return out


# 3-4. learning ------------------------------------------------------------------------------------

def learn_summaries(summary_paths: Sequence[str | Path], out_path: str | Path,
                    tokenizer_fingerprint: str | None = None) -> dict[str, Any]:
    """The dataset's conventions from its shards' summaries (nothing else is read), merged as they are
    read: one summary in memory at a time (about 20 KB each as Python objects; a 2M-sample dataset has
    2,000). With ``tokenizer_fingerprint``, every shard must have been reconstructed with that
    tokenizer (:func:`refuse_stale_parts`): that refusal comes first, also where a current summary does
    not merge."""
    stale: list[tuple[Path, str | None]] = []

    def current() -> Iterator[dict[str, Any]]:
        for p in summary_paths:
            summary = json.loads(Path(p).read_text(encoding="utf-8"))
            fp = summary.get("tokenizer_fingerprint")
            if tokenizer_fingerprint is None or fp == tokenizer_fingerprint:
                yield summary
            else:
                stale.append((Path(p), fp))

    read = current()
    try:
        merged = summaries.merge(read)
    finally:
        for _ in read:  # (where the merge failed: the rest read for their fingerprints)
            pass
        if stale:
            refuse_stale_parts(stale, len(summary_paths), tokenizer_fingerprint)  # (stale: a fingerprint given)
    conventions, reliability, variants = summaries.learn(merged)
    learned = {"rows": merged["rows"], "conventions": conventions, "reliability": reliability, "variants": variants}
    atomic_write_json(out_path, learned)
    return learned


def refuse_stale_parts(stale: Sequence[tuple[Path, str | None]], shards: int, fingerprint: str) -> None:
    """Raise :class:`StageError` for the shards whose summary records another tokenizer fingerprint
    than ``fingerprint`` (the dataset's tokenizer as the gathering job loads it), or none (``stale``:
    (summary path, its fingerprint) pairs, of ``shards`` in all). The stage stamp reruns every shard
    when the tokenizer's files or settings change; this catches what it cannot see (a hub id whose
    files were updated, a library upgrade that changes what a tokenizer loads), which would otherwise
    mix two tokenizers' ids in one dataset."""
    if not stale:
        return
    shown = "; ".join(f"{path.name.removesuffix('.summary.json')} ({(fp or 'not recorded')[:16]})" for path, fp in stale[:5])
    more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
    parts = stale[0][0].parent
    raise StageError(
        f"{parts}: {len(stale)} of {shards} shards were reconstructed with another tokenizer than the "
        f"dataset's as loaded now ({fingerprint[:16]}): {shown}{more}. The tokenizer changed in a way the "
        "workflow does not track (a hub id's files updated, a library upgrade), so gathering them would mix "
        f"two tokenizers' ids. Remove their parts (rm {parts}/<shard>.parquet {parts}/<shard>.summary.json) "
        "and run again, or rebuild every shard: snakemake --forcerun token_shard")


def learn_repairs(learned_path: str | Path, part_paths: Sequence[str | Path], out_path: str | Path,
                  tokenizer: Tokenizer, family: ModelFamily, pool: Executor | None = None) -> dict[str, Any]:
    """``learned.json`` plus ``repairs``: per provider, the transformations samples prove it applies
    (searched on the samples needing a repair, one part at a time, in ``pool``'s processes too where
    given; at least :data:`~eagledata.tokens.shards.MIN_REPAIR_EVIDENCE` samples each, counted in
    ``repair_evidence``), and ``key_order_kept`` where as many samples' arguments prove the provider keeps
    key order."""
    learned = json.loads(Path(learned_path).read_text(encoding="utf-8"))
    tasks = [(path, learned["conventions"], learned["reliability"]) for path in part_paths]
    found: dict[str, dict[str, int]] = {}
    for counts in _each(pool, _part_repair_counts, tasks, tokenizer, family):
        _add_counts(found, counts)
    learned["repairs"] = {p: sorted(ts) for p, ts in proven_repairs(found).items()}
    learned["repair_evidence"] = found
    atomic_write_json(out_path, learned)
    return learned


def _part_repair_counts(task: tuple, tokenizer: Tokenizer, family: ModelFamily) -> dict[str, dict[str, int]]:
    """Per provider, the repairs a part's samples needing one show (``task``: the part, the learned
    conventions and reliability)."""
    path, conventions, reliability = task
    judge = Judge(conventions, reliability, tokenizer, family)
    df = pl.read_parquet(path, columns=[c for c in PART_SCHEMA if c not in ("input_ids", "segments")])
    stats = part_stats(df)
    judged = judge.first_verdicts(stats)
    segs = pl.read_parquet(path, columns=["segments", "finish_reason"])
    return judge.repair_behaviours(stats, judged, _segment_rows(segs))


def _segment_rows(df: pl.DataFrame) -> Iterator[tuple[int, tuple[str, str | None]]]:
    """(row, (segments, finish_reason)) of each of ``df``'s rows."""
    return enumerate(zip(df.get_column("segments"), df.get_column("finish_reason")))


# 5-6. judging and the manifest (one dataset job) ----------------------------------------------------

def judge_shard(part_path: str | Path, learned: Mapping[str, Any], store_dir: str | Path, tokenizer: Tokenizer,
                family: ModelFamily, policy: Any = "default") -> dict[str, Any]:
    """One shard's final file (in ``store_dir``, untouched when its content exists) and its manifest
    entry, under the dataset's ``learned`` conventions (``conventions.json``). Judged
    :data:`BATCH_ROWS` rows at a time (every check is per sample), written in one piece."""
    judge = Judge(learned["conventions"], learned["reliability"], tokenizer, family)
    known = {p: set(ts) for p, ts in learned["repairs"].items()}
    admitted = resolve_policy(policy)
    part = pl.read_parquet(part_path)
    verdicts, seen = VerdictColumns(learned["variants"], admitted), {}
    for start in range(0, part.height, BATCH_ROWS):
        chunk = part.slice(start, BATCH_ROWS)
        stats = part_stats(chunk)
        judged = judge.first_verdicts(stats)

        judge.apply_repairs(stats, judged, _segment_rows(chunk), known)
        judge.ambiguity_check(stats, judged, _segment_rows(chunk), known)
        verdicts.add(stats, judged)
        _add_counts(seen, transformations_seen(stats, judged))
    # (the verdict columns put on the whole part at once: per batch, polars' calls and the batches' frames
    # gathered again cost more than the judging of a short sample)
    df = verdicts.on(part.drop(list(_STATS_SCHEMA))).rechunk()
    del part, verdicts
    # the ids cast to the final shard's 64 bits last (the 32-bit ones and the 64-bit ones are held together
    # only while cast: the job's peak follows the largest shard's ids)
    df = df.with_columns(pl.col("input_ids").cast(PASS1_SCHEMA["input_ids"]))
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".judge-{Path(part_path).stem}.parquet.tmp-{os.getpid()}"
    try:
        df.write_parquet(tmp, compression="zstd")
        sha = sha256_file(tmp)
        dest = store / shard_name(sha)
        kept = replace_unless_same(tmp, dest, sha)
    finally:
        tmp.unlink(missing_ok=True)
    ids = df["id"]
    # (an expression: a filtered copy of the trained rows held their columns, ids too, once more)
    longest = int(df.select((pl.col("prompt_len") + pl.col("completion_len")).filter(pl.col("train")).max()).item()
                  or 0)  # (None: no train row)
    return {"file": dest.name, "rows": df.height, "sha256": sha, "first_id": ids[0] if df.height else None,
            "last_id": ids[-1] if df.height else None, "longest_train": longest, "kept": kept,
            "transformations_seen": seen}


def judge_and_gather(plan_path: str | Path, part_paths: Sequence[str | Path], conventions_path: str | Path,
                     out_dir: str | Path, store_dir: str | Path, tokenizer: Tokenizer, family: ModelFamily,
                     policy: Any = "default", pool: Executor | None = None, processes: int = 1) -> dict[str, Any]:
    """Judge every shard (``part_paths`` in the plan's order; one part in memory per process, in ``pool``'s
    processes too where given: ``processes`` with this one, for the log) and write
    ``out_dir/manifest.json`` (as the one-job stage writes it) and a hard link per shard; the store keeps
    exactly the manifest's shards. Returns the manifest."""
    plan = read_plan(plan_path)
    keys = [s["key"] for s in plan["shards"]]
    if [Path(p).name.split(".")[0] for p in part_paths] != keys:
        raise ValueError(f"{plan_path}: the parts given are not the plan's shards in its order")
    learned = json.loads(Path(conventions_path).read_text(encoding="utf-8"))
    entries = _each(pool, _judged_part, [(path, learned, store_dir, policy) for path in part_paths], tokenizer, family)
    log.info("%d shards judged in %d process(es): %d written, %d unchanged (left untouched)", len(entries),
             processes, sum(not e["kept"] for e in entries), sum(e["kept"] for e in entries))
    return _write_manifest(plan, learned, entries, out_dir, store_dir, tokenizer, family, policy)


def _judged_part(task: tuple, tokenizer: Tokenizer, family: ModelFamily) -> dict[str, Any]:
    """:func:`judge_shard` of ``task`` (the part, the learned conventions, the store, the policy)."""
    path, learned, store_dir, policy = task
    return judge_shard(path, learned, store_dir, tokenizer, family, policy)


def _each(pool: Executor | None, step: Callable[..., Any], tasks: Sequence[tuple], tokenizer: Tokenizer,
          family: ModelFamily) -> list[Any]:
    """``[step(task, tokenizer, family) for task in tasks]``, in ``pool``'s helpers (:func:`helper_pool`)
    and this process together where a pool is given."""
    if pool is None:
        return [step(task, tokenizer, family) for task in tasks]
    return shared_map(pool, functools.partial(_in_helper, step), lambda task: step(task, tokenizer, family), tasks)


def helper_pool(helpers: int, tokenizer: Tokenizer, family: ModelFamily) -> contextlib.AbstractContextManager:
    """A pool of ``helpers`` spawned processes holding ``tokenizer`` and ``family`` (for :func:`_each`); a
    context giving None for none."""
    if helpers < 1:
        return contextlib.nullcontext()
    return spawned_pool(helpers, initializer=_helper_init, initargs=(tokenizer, family))


_HELPER_ARGS: tuple = ()


def _helper_init(*args: Any) -> None:
    global _HELPER_ARGS
    verify_inherited_code()  # a spawned helper imports the code on disk now: the job's stamps' code?
    _HELPER_ARGS = args


def _in_helper(step: Callable[..., Any], task: tuple) -> Any:
    return step(task, *_HELPER_ARGS)


def learn_and_judge(plan_path: str | Path, work_dir: str | Path, out_dir: str | Path, store_dir: str | Path,
                    tokenizer: Tokenizer, family: ModelFamily, policy: Any = "default", workers: int = 1) -> dict[str, Any]:
    """Steps 3-5 in one job, after every shard's reconstruction: ``learned.json`` and
    ``conventions.json`` in ``work_dir`` (kept for inspection), then the judged shards and the
    manifest, the repair search and the judging in up to ``workers`` processes (spawned helpers, when there
    are at least two parts a process: a helper costs about a job's start). Returns the manifest."""
    w = Path(work_dir)
    paths = [work_paths(w, k) for k in plan_keys(plan_path)]
    parts = [p["part"] for p in paths]
    helpers = workers - 1 if len(parts) >= 2 * workers else 0
    with helper_pool(helpers, tokenizer, family) as pool:  # (its processes start with the first part given them)
        learned = learn_summaries([p["summary"] for p in paths], w / "learned.json", tokenizer.fingerprint)
        log.info("%d samples in %d shard summaries; conventions: %s", learned["rows"], len(paths), learned["conventions"])
        repairs = learn_repairs(w / "learned.json", parts, w / "conventions.json", tokenizer, family, pool)
        log.info("repairs proven per provider: %s", repairs["repairs"])
        return judge_and_gather(plan_path, parts, w / "conventions.json", out_dir, store_dir, tokenizer, family,
                                policy, pool, 1 + helpers)


def _add_counts(into: dict[str, dict[str, int]], counts: Mapping[str, Mapping[str, int]]) -> None:
    """Add per-provider code counts (``transformations_seen``) into ``into``."""
    for provider, by_code in counts.items():
        c = into.setdefault(provider, {})
        for code, n in by_code.items():
            c[code] = c.get(code, 0) + n


def _write_manifest(plan: Mapping[str, Any], learned: dict[str, Any], entries: Sequence[Mapping[str, Any]],
                    out_dir: str | Path, store_dir: str | Path, tokenizer: Tokenizer, family: ModelFamily,
                    policy: Any) -> dict[str, Any]:
    out, store = Path(out_dir), Path(store_dir)
    out.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)  # (a dataset of no sample has no shard in it)
    conventions = learned["conventions"]
    seen: dict[str, dict[str, int]] = {}
    for e in entries:
        _add_counts(seen, e["transformations_seen"])
    report = Learned(conventions, learned["reliability"], learned["variants"])
    for provider, c in seen.items():
        conventions[provider]["transformations_seen"] = c
    report.conventions = conventions
    for provider, r in report.reliability.items():
        conventions[provider]["reasoning_count"] = r
    for provider, v in report.variants.items():
        conventions[provider]["prompt_rendering"] = v
    # longest_train: the longest train sample (prompt + completion tokens; 0 for none): the extraction's
    # length limit acts on the shard only above it (eagledata.extract.plan)
    shards = [{k: e[k] for k in ("file", "rows", "sha256", "first_id", "last_id", "longest_train")} for e in entries]
    for s in shards:
        publish_shard(store / s["file"], out / s["file"], s["sha256"])
    admitted = resolve_policy(policy)
    manifest = {
        "dataset": plan["dataset"], "source": plan["source"], "source_records_sha256": plan["source_records_sha256"],
        "tokenizer": tokenizer.source, "tokenizer_fingerprint": tokenizer.fingerprint, "family": family.name,
        "policy": admitted.name, "policy_sets": admitted.to_dict(), "conventions": conventions,
        "rows": sum(s["rows"] for s in shards),
        "sharding": {"rule": SHARDING_RULE, "shard_size": plan["sharding"]["shard_size"],
                     "max_rows": plan["sharding"]["max_rows"], "store": os.path.relpath(store, out),
                     "key": plan["sharding"]["key"]},
        "shards": [{**s, "key": sh["key"]} for s, sh in zip(shards, plan["shards"])],
    }
    atomic_write_json(out / "manifest.json", manifest)
    names = [s["file"] for s in shards]
    prune_shards(out, names)
    prune_shards(store, names)
    return manifest


__all__ = ["PART_SCHEMA", "iter_slice", "run_shard_job", "judge_and_gather", "judge_shard", "learn_and_judge", "learn_repairs", "learn_summaries",
           "part_stats", "refuse_stale_parts", "peak_memory_mb", "plan_keys", "read_plan", "reconstruct_shard", "shard_key", "slice_sources", "work_paths"]
