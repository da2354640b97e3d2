"""Token stage: a dataset's responses file -> Parquet token shards with verdicts, plus a manifest.

Columns of every shard: ``id``, ``provider``, ``model``, ``finish_reason``, ``status``, ``input_ids``
(prompt + completion, int64), ``prompt_len``, ``completion_len``, ``reasoning_len``, ``billed_prompt``,
``billed_completion``, ``billed_reasoning``, ``completion_diff`` (ours minus billed under the
provider's convention), ``prompt_diff``, ``flags`` (reconstruction flags), ``verdict`` (both sides
together: a differing prompt makes it ``mismatch``), ``completion_verdict`` (exact | repaired |
mismatch | error), ``prompt_verdict`` (exact | unproven | differs | unbilled | error), ``prompt_variant`` (the
provider's learned rendering variant explaining a differing prompt, else null), ``reasons``,
``train`` (the dataset's policy admits the sample, see :mod:`eagledata.tokens.policy`), ``segments`` and
``tool_id_rewrites`` (JSON), ``repair`` (evidence, JSON), ``cost``. ``manifest.json`` lists shards
in order (``file``, ``rows``, ``sha256``, ``first_id``, ``last_id``), the sharding rule, the
tokenizer fingerprint, the policy and what was learned per provider: count conventions, reasoning
count reliability and prompt rendering variants.

**Stable shards (content-defined by id).** A sample's shard depends on its id, never on its line in
the responses file. Samples are sorted by id (Python string order) and a new shard starts at every
id whose ``int(sha256(id as UTF-8), 16) % shard_size == 0`` (a *boundary id*), so shards hold
``shard_size`` samples on average; a shard that reaches ``MAX_SHARD_FACTOR * shard_size`` rows (4x)
is cut there regardless, so none grows without bound (about 2% of shards at a large ``shard_size``).
Inserting or removing one sample therefore changes one shard: the one whose id range holds it (two
when the new id is itself a boundary id, which splits a shard; a removed boundary id merges two).
Only a run of forced cuts shifts, up to the next boundary id. Records without an ``id`` get
``{dataset}-{line:06d}``, which depends on the line: give samples ids to keep their shards stable.
Each shard file is named by its content, ``shard-<first 16 hex of its sha256>.parquet``, so an
unchanged shard keeps its name, and a changed one gets a new name (its old file is removed).

**Untouched shards.** Every shard is written to a temporary file, hashed, and kept only if no file of
that content exists yet: an unchanged shard keeps its bytes, inode and mtime, so whatever depends on
it (extraction skips shards whose source sha256 it has done) has nothing to redo. The conventions are
learned over the whole dataset, so a new sample that changes a learned convention changes verdicts,
and so files, in other shards too: those legitimately change.

**Where the files live.** The ``tokens`` rule's output is a Snakemake ``directory()``, which Snakemake
deletes before rerunning the job, so files kept inside it would not survive a rerun. The shards
therefore live in a store directory that is *not* an output (``store_dir``; the rule passes the
sibling ``{dataset}/tokens.store``, as the generate stage keeps its paid responses outside the
outputs), and the declared ``tokens/`` directory gets ``manifest.json`` and a hard link per shard
(a copy with the same mtime where the file system cannot link), so every reader of ``tokens/`` is
unchanged. Snakemake's ``update()`` flag would keep the directory too, but it copies the whole
directory to a backup before every run; declaring only the manifest would change every downstream
rule's input. After a successful run the store holds exactly the manifest's shards. Without
``store_dir`` the shards are written (and kept when unchanged) in ``out_dir`` itself.

Memory stays flat: a first pass reads ids and byte offsets only; the second reconstructs samples in
id order, writing one shard at a time to a scratch directory; verdicts need every sample's counts (to
learn each provider's convention, from the samples in file order), so a third pass adds them to each
shard and writes its final file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import polars as pl

from eagledata.tokens.checks import (COUNT_CODES, REASONS, SampleStats, completion_verdict, convention_for, count_vote,
                     learn_conventions, prompt_verdict, repairable, sample_stats, verdict, verdict_of)
from eagledata.tokens.learning import (learn_prompt_variants, learn_reasoning_reliability, provider_sorts_tool_keys,
                                      reasoning_checked, reasoning_vote, request_order_explains, sample_variant)
from eagledata.tokens.policy import Policy, resolve_policy
from eagledata.tokens.repairs import (ARGUMENTS_RESPACED, KEY_ORDER_KEPT, key_order_in_question, shows_key_order_kept, WHITESPACE_CONTENT, WHITESPACE_REASONING, RepairResult, SampleCandidates,
                      parsed_from_segments, search_repairs)
from eagledata.tokens.reconstruct import segments_json
from eagledata.errors import InputError
from eagledata.text.families import ModelFamily
from eagledata.io import (ResponsesFileError, atomic_write_json, iter_json_lines, link_file, loads_json, open_lines,
                          replace_unless_same, sha256_file)
from eagledata.tokens.responses import ParsedResponse
from eagledata.tokens.samples import alternative_prompt_lengths, tokenize_record
from eagledata.tokens.sharding import MAX_SHARD_FACTOR, checked_record, is_boundary_id, record_id
from eagledata.text.tokenizer import Tokenizer

__all__ = ["MAX_SHARD_FACTOR", "ResponsesFileError", "TokenStageResult", "build_token_shards", "is_boundary_id",
           "iter_records", "read_shards", "sha256_file", "shard_groups", "shard_name"]

SHARD_PREFIX = "shard-"


def shard_groups(ids: Sequence[str], shard_size: int, max_factor: int = MAX_SHARD_FACTOR) -> list[list[str]]:
    """``ids`` cut into shards by the content-defined rule (see the module docstring): sorted, a new
    shard at each boundary id, and at ``max_factor * shard_size`` rows at the latest. Always at
    least one (possibly empty) shard."""
    if shard_size < 1:
        raise InputError(f"tokens.shard_size must be >= 1, got {shard_size}")
    cap = max_factor * shard_size
    groups: list[list[str]] = [[]]
    for sid in sorted(ids):
        cur = groups[-1]
        if cur and (len(cur) >= cap or is_boundary_id(sid, shard_size)):
            groups.append(cur := [])
        cur.append(sid)
    return groups


def shard_name(sha256_hex: str) -> str:
    """A shard's file name from its content's sha256."""
    return f"{SHARD_PREFIX}{sha256_hex[:16]}.parquet"


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) of a responses JSONL (any shape :func:`normalize_response_line`
    accepts); bad lines raise naming file:line:field."""
    for lineno, where, rec in iter_json_lines(path, ResponsesFileError, "responses file"):
        yield lineno, checked_record(rec, where)


def _line_offsets(path: str | Path) -> list[int]:
    """Byte offset of every line's start (index = line number - 1)."""
    offsets, pos = [], 0
    with open_lines(path) as fh:
        for raw in fh:
            offsets.append(pos)
            pos += len(raw)
    return offsets


@dataclass
class _Entry:
    sid: str
    lineno: int
    offset: int


@dataclass
class TokenStageResult:
    manifest: dict[str, Any]
    stats: list[SampleStats]  # in file order
    written: list[str] = field(default_factory=list)  # shard files (re)written by this run
    kept: list[str] = field(default_factory=list)  # shard files left untouched (same content)


def build_token_shards(
    responses_path: str | Path,
    out_dir: str | Path,
    tokenizer: Tokenizer,
    family: ModelFamily,
    dataset: str,
    shard_size: int = 1000,
    policy: str | Mapping[str, Any] | Policy = "default",
    template: str | None = None,
    store_dir: str | Path | None = None,
) -> TokenStageResult:
    """Write ``out_dir/manifest.json`` and the shards (in ``store_dir``, linked into ``out_dir``; in
    ``out_dir`` itself without ``store_dir``). One writer per store at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = Path(store_dir) if store_dir is not None else out
    store.mkdir(parents=True, exist_ok=True)
    admitted = resolve_policy(policy)
    entries = index_records(responses_path, dataset)
    groups = shard_groups(list(entries), shard_size)
    scratch = store / f".work-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        stats, linenos, parts = _reconstruct_parts(responses_path, entries, groups, scratch, tokenizer, family, template)
        # Learned over the whole dataset, from the samples in file order.
        file_order = sorted(range(len(stats)), key=linenos.__getitem__)
        file_stats = [stats[i] for i in file_order]
        learned = Learned.of(file_stats)
        judged = _judge(scratch, parts, stats, learned.conventions, tokenizer, family, learned.reliability)
        result = TokenStageResult({}, file_stats)
        shards_meta = _write_shards(scratch, parts, store, stats, judged, learned.variants, admitted, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    names = [s["file"] for s in shards_meta]
    if store != out:
        for s in shards_meta:
            publish_shard(store / s["file"], out / s["file"], s["sha256"])
    conventions = learned.report(file_stats, [judged[i] for i in file_order])
    manifest = {
        "dataset": dataset,
        "source": str(responses_path),
        "source_sha256": sha256_file(responses_path),
        "tokenizer": tokenizer.source,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "family": family.name,
        "policy": admitted.name,
        "policy_sets": admitted.to_dict(),
        "conventions": conventions,
        "rows": len(file_stats),
        "sharding": {"rule": "ids sorted; a shard starts at each id with int(sha256(id), 16) % shard_size == 0",
                     "shard_size": shard_size, "max_rows": MAX_SHARD_FACTOR * shard_size,
                     "store": None if store == out else os.path.relpath(store, out)},
        "shards": shards_meta,
    }
    atomic_write_json(out / "manifest.json", manifest)
    prune_shards(out, names)
    if store != out:
        prune_shards(store, names)
    result.manifest = manifest
    return result


def index_records(responses_path: str | Path, dataset: str) -> dict[str, _Entry]:
    """Pass 1: every record's id and where its line starts (ids must be unique)."""
    offsets = _line_offsets(responses_path)
    entries: dict[str, _Entry] = {}
    for lineno, rec in iter_records(responses_path):
        sid = record_id(rec, f"{dataset}-{lineno:06d}")
        if sid in entries:
            raise ResponsesFileError(f"{responses_path}:{lineno}: field 'id': duplicate id {sid!r}")
        entries[sid] = _Entry(sid, lineno, offsets[lineno - 1])
    return entries


def _reconstruct_parts(responses_path: str | Path, entries: Mapping[str, _Entry], groups: list[list[str]],
                       scratch: Path, tokenizer: Tokenizer, family: ModelFamily,
                       template: str | None) -> tuple[list[SampleStats], list[int], list[str]]:
    """Pass 2: reconstruct in id order, one scratch part per shard: (stats, line numbers, parts)."""
    stats: list[SampleStats] = []
    linenos: list[int] = []
    parts: list[str] = []
    with open_lines(responses_path) as fh:
        for k, group in enumerate(groups):
            rows = []
            for sid in group:
                e = entries[sid]
                fh.seek(e.offset)
                rec = checked_record(json.loads(fh.readline().decode("utf-8")), f"{responses_path}:{e.lineno}")
                st, row = reconstruct_sample(rec, sid, tokenizer, family, template)
                stats.append(st)
                linenos.append(e.lineno)
                rows.append(row)
            parts.append(f"part-{k:06d}.parquet")
            pl.DataFrame(rows, schema=PASS1_SCHEMA).write_parquet(scratch / parts[-1], compression="zstd")
    return stats, linenos, parts


@dataclass
class Learned:
    """What the dataset's samples teach about each provider."""

    conventions: dict[str, dict]
    reliability: dict[str, dict]
    variants: dict[str, dict]

    @classmethod
    def of(cls, stats: list[SampleStats]) -> "Learned":
        conventions = learn_conventions(stats)
        return cls(conventions, learn_reasoning_reliability(stats, conventions), learn_prompt_variants(stats))

    def report(self, stats: list[SampleStats], judged: list[Judgement]) -> dict[str, dict]:
        """The manifest's ``conventions``: per provider, everything learned, with what repairs saw."""
        conventions = self.conventions
        for provider, seen in transformations_seen(stats, judged).items():
            conventions[provider]["transformations_seen"] = seen
        for provider, r in self.reliability.items():
            conventions[provider]["reasoning_count"] = r
        for provider, v in self.variants.items():
            conventions[provider]["prompt_rendering"] = v
        return conventions


def _write_shards(scratch: Path, parts: list[str], store: Path, stats: list[SampleStats], judged: list[Judgement],
                  variants: Mapping[str, Mapping], admitted: Policy, result: TokenStageResult) -> list[dict[str, Any]]:
    """Pass 3: verdicts into each shard; a shard whose content exists already is left untouched."""
    shards_meta: list[dict[str, Any]] = []
    i = 0
    for k, part in enumerate(parts):
        df = with_verdicts(pl.read_parquet(scratch / part), stats, judged, i, variants, admitted)
        i += df.height
        tmp = scratch / f"final-{k:06d}.parquet"
        df.write_parquet(tmp, compression="zstd")
        sha = sha256_file(tmp)
        name = shard_name(sha)
        (result.kept if replace_unless_same(tmp, store / name, sha) else result.written).append(name)
        ids = df["id"]
        shards_meta.append({"file": name, "rows": df.height, "sha256": sha,
                            "first_id": ids[0] if df.height else None, "last_id": ids[-1] if df.height else None})
    return shards_meta


def reconstruct_sample(rec: dict[str, Any], sid: str, tokenizer: Tokenizer, family: ModelFamily,
                      template: str | None, parsed: ParsedResponse | None = None) -> tuple[SampleStats, dict[str, Any]]:
    """One record's stats and part row (``parsed``: its response, when parsed already)."""
    sample = tokenize_record(rec, tokenizer, family, sid, template, parsed)
    st = sample_stats(sample, tokenizer, family)
    if st.prompt_diff is not None and st.has_tools:  # json_tools only explains a differing count
        st.prompt_alt = alternative_prompt_lengths(sample, tokenizer, template, json_tools=st.prompt_diff != 0)
    p = sample.parsed
    return st, {
        "id": sid, "provider": st.provider, "model": p.model, "finish_reason": p.finish_reason,
        "status": int(rec.get("status") or 0), "input_ids": sample.input_ids,
        "prompt_len": st.prompt_len, "completion_len": st.completion_len, "reasoning_len": st.reasoning_len,
        "billed_prompt": st.billed_prompt, "billed_completion": st.billed_completion,
        "billed_reasoning": st.billed_reasoning, "flags": sample.completion.flags,
        "segments": segments_json(sample.completion.segments),
        "tool_id_rewrites": json.dumps(sample.completion.tool_id_rewrites, ensure_ascii=False),
        "cost": p.cost,
    }


def with_verdicts(df: pl.DataFrame, stats: Sequence[SampleStats], judged: Sequence["Judgement"], start: int,
                   variants: Mapping[str, Any], admitted: Policy) -> pl.DataFrame:
    """A scratch part with its verdict columns (its first row is sample ``start`` of ``stats``/``judged``):
    :class:`VerdictColumns` of its rows, put on it."""
    columns = VerdictColumns(variants, admitted)
    columns.add(stats[start:start + df.height], judged[start:start + df.height])
    return columns.on(df)


class VerdictColumns:
    """A shard's verdict columns, gathered batch by batch (:meth:`add`, in row order) and put on the
    shard's frame once (:meth:`on`): what a sample's stats and judgement decide, a few small values a
    row, and the rows a chosen repair replaces. A prompt the billed count cannot prove (``unproven``: the
    tools' key order, given the provider's learned ``variants``) adds ``prompt_order_unproven`` to the
    sample's reasons and joint verdict (its judgement is changed as it is added). A repaired row is held
    compactly until then (:class:`RepairedRow`), not as its reconstruction."""

    NAMES = ("completion_diff", "prompt_diff", "verdict", "completion_verdict", "prompt_verdict", "prompt_variant",
             "reasons", "train", "repair")

    def __init__(self, variants: Mapping[str, Any], admitted: Policy) -> None:
        self.variants, self.admitted = variants, admitted
        self.cols: dict[str, list] = {k: [] for k in self.NAMES}
        self.repaired: dict[int, RepairedRow] = {}
        self.rows = 0

    def add(self, stats: Sequence[SampleStats], judged: Sequence["Judgement"]) -> None:
        """The next rows: ``stats[i]`` and ``judged[i]`` are row ``self.rows + i``'s."""
        cols, variants = self.cols, self.variants
        for st, j in zip(stats, judged):
            if j.repair is not None and j.repair.chosen is not None:
                self.repaired[self.rows] = RepairedRow.of(st, j.repair.chosen)
            self.rows += 1
            cols["completion_diff"].append(j.completion_diff)
            cols["prompt_diff"].append(st.prompt_diff)
            c_verdict = completion_verdict(j.reasons)
            p_verdict = prompt_verdict(st, provider_sorts_tool_keys(variants, st.provider), request_order_explains(variants, st))
            if p_verdict == "unproven" and "prompt_order_unproven" not in j.reasons:  # the joint verdict: not proven
                j.reasons.append("prompt_order_unproven")
                j.verdict = verdict_of(j.reasons)
            cols["verdict"].append(j.verdict)
            cols["completion_verdict"].append(c_verdict)
            cols["prompt_verdict"].append(p_verdict)
            cols["prompt_variant"].append(sample_variant(variants, st))
            cols["reasons"].append(j.reasons)
            cols["train"].append(self.admitted.admits(c_verdict, p_verdict))
            cols["repair"].append(json.dumps(j.evidence) if j.evidence else None)

    def on(self, df: pl.DataFrame) -> pl.DataFrame:
        """``df`` (the rows added, in order) with the verdict columns and the repaired rows' values."""
        if df.height != self.rows:
            raise ValueError(f"verdicts of {self.rows} rows put on a frame of {df.height}")
        cols = self.cols
        return df.with_columns(
            *_repaired_columns(df, self.repaired),
            pl.Series("completion_diff", cols["completion_diff"], dtype=pl.Int64),
            pl.Series("prompt_diff", cols["prompt_diff"], dtype=pl.Int64),
            pl.Series("verdict", cols["verdict"], dtype=pl.Utf8),
            pl.Series("completion_verdict", cols["completion_verdict"], dtype=pl.Utf8),
            pl.Series("prompt_verdict", cols["prompt_verdict"], dtype=pl.Utf8),
            pl.Series("prompt_variant", cols["prompt_variant"], dtype=pl.Utf8),
            few_distinct_lists("reasons", cols["reasons"]),
            pl.Series("train", cols["train"], dtype=pl.Boolean),
            pl.Series("repair", cols["repair"], dtype=pl.Utf8),
        )


def few_distinct_lists(name: str, lists: Sequence[Sequence[str]]) -> pl.Series:
    """``pl.Series(name, lists, dtype=pl.List(pl.Utf8))`` for lists of which few are distinct (reason
    codes): each distinct list made once and gathered, where polars builds a series for every row's list."""
    index: dict[tuple[str, ...], int] = {}
    rows = [index.setdefault(tuple(codes), len(index)) for codes in lists]
    return pl.Series(name, [list(codes) for codes in index], dtype=pl.List(pl.Utf8)).gather(rows)


#: (``input_ids``: None, its dtype in the frame: 64-bit in a shard, 32-bit in a per-shard part, cast
#: when the shard is gathered)
_REPAIRABLE_COLUMNS = {"input_ids": None, "segments": pl.Utf8, "completion_len": pl.Int32, "reasoning_len": pl.Int32}


class RepairedRow(NamedTuple):
    """What a chosen repair replaces in its row: the prompt's length (its ids are the row's), the
    completion's ids (32-bit, as a part holds them), segments (JSON) and counts."""

    prompt_len: int
    completion_ids: array
    segments: str
    reasoning_len: int

    @classmethod
    def of(cls, st: SampleStats, chosen: Any) -> "RepairedRow":
        return cls(st.prompt_len, array("i", chosen.ids), segments_json(chosen.segments), chosen.reasoning_tokens)


def _repaired_columns(df: pl.DataFrame, repaired: Mapping[int, RepairedRow]) -> list:
    """The columns a chosen repair replaces, with the repaired rows' values: only those rows are made
    anew, the others' slices kept (turning every id of a chunk into a Python int and back was most of
    judging's time); one contiguous column each, as built whole."""
    dtypes = {name: dtype or df.schema[name] for name, dtype in _REPAIRABLE_COLUMNS.items()}
    if not repaired:
        return [pl.col(name).cast(dtype) for name, dtype in dtypes.items()]
    rows = sorted(repaired)
    new: dict[str, list] = {name: [] for name in dtypes}
    for row in rows:
        r = repaired[row]
        new["input_ids"].append(df["input_ids"][row].to_list()[: r.prompt_len] + r.completion_ids.tolist())
        new["segments"].append(r.segments)
        new["completion_len"].append(len(r.completion_ids))
        new["reasoning_len"].append(r.reasoning_len)
    columns = []
    for name, dtype in dtypes.items():
        column, values, pieces, start = df[name].cast(dtype), pl.Series(name, new[name], dtype=dtype), [], 0
        for k, row in enumerate(rows):
            pieces += [column.slice(start, row - start), values.slice(k, 1)]
            start = row + 1
        pieces.append(column.slice(start))
        columns.append(pl.concat(pieces).rechunk().alias(name))
    return columns


def publish_shard(src: Path, dst: Path, sha: str) -> None:
    """``dst`` = ``src`` (a hard link; a copy keeping the mtime where linking fails), left alone when it
    already is that file or a copy of it."""
    if dst.is_file():
        if os.path.samefile(src, dst) or (dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha):
            return
    link_file(src, dst)


def prune_shards(directory: Path, keep: Sequence[str]) -> None:
    """Remove shard files not in ``keep`` and scratch directories of earlier (killed) runs."""
    keep = set(keep)
    for p in directory.iterdir():
        if p.name.startswith(SHARD_PREFIX) and p.name.endswith(".parquet") and p.name not in keep and p.is_file():
            p.unlink()
        elif p.name.startswith(".work-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


PASS1_SCHEMA: Mapping[str, Any] = {
    "id": pl.Utf8, "provider": pl.Utf8, "model": pl.Utf8, "finish_reason": pl.Utf8, "status": pl.Int32,
    "input_ids": pl.List(pl.Int64), "prompt_len": pl.Int32, "completion_len": pl.Int32, "reasoning_len": pl.Int32,
    "billed_prompt": pl.Int64, "billed_completion": pl.Int64, "billed_reasoning": pl.Int64,
    "flags": pl.List(pl.Utf8), "segments": pl.Utf8, "tool_id_rewrites": pl.Utf8, "cost": pl.Float64,
}


def read_shards(tokens_dir: str | Path, columns: list[str] | None = None) -> pl.DataFrame:
    """All shards of a token directory, in order, after checking each shard's sha256."""
    d = Path(tokens_dir)
    manifest = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    frames = []
    for shard in manifest["shards"]:
        path = d / shard["file"]
        actual = sha256_file(path)
        if actual != shard["sha256"]:
            raise ResponsesFileError(f"{path}: sha256 {actual} does not match manifest {shard['sha256']}")
        frames.append(pl.read_parquet(path, columns=columns))
    return pl.concat(frames) if frames else pl.DataFrame()


@dataclass
class Judgement:
    verdict: str
    reasons: list[str]
    completion_diff: int | None
    repair: RepairResult | None = None

    @property
    def evidence(self) -> dict[str, Any] | None:
        if self.repair is None or self.repair.status == "not_applicable":
            return None
        return {"status": self.repair.status, "transforms": list(self.repair.transforms),
                "candidates": self.repair.evidence}


def _row_parsed(segments_json: str, finish_reason: str | None):
    return parsed_from_segments(loads_json(segments_json), finish_reason)


def _thinking_of(segments_json: str) -> bool:
    kinds = {seg["kind"] for seg in loads_json(segments_json)}
    return bool(kinds & {"reasoning", "think_close", "think_open"})


def _judge(out: Path, shard_files: list[str], stats: list[SampleStats], conventions: dict[str, dict],
           tokenizer: Tokenizer, family: ModelFamily, reliability: Mapping[str, Mapping] | None = None) -> list[Judgement]:
    """Verdicts for every sample. Count mismatches get a repair search; a provider proven to strip
    leading spaces (a unique whitespace repair somewhere in the dataset) makes its exact samples
    that would also match with a space restored ambiguous. A provider whose reasoning count is not a
    checksum (``reliability``) is judged, and its repairs searched, on the completion total alone.
    The steps (:class:`Judge`) each need
    only one sample at a time plus what the dataset taught, so the per-shard jobs run them shard by shard."""
    judge = Judge(conventions, reliability or {}, tokenizer, family)
    judged = judge.first_verdicts(stats)
    def rows() -> Iterator[tuple[int, tuple]]:
        return enumerate(_shard_rows(out, shard_files, ["segments", "finish_reason"]))

    learned = proven_repairs(judge.repair_behaviours(stats, judged, rows()))
    judge.apply_repairs(stats, judged, rows(), learned)
    judge.ambiguity_check(stats, judged, rows(), learned)
    return judged


@dataclass
class Judge:
    """What judging a sample needs beyond the sample: the dataset's learned conventions and
    reasoning-count reliability, the tokenizer and family (repair candidates are re-encoded)."""

    conventions: Mapping[str, Mapping]
    reliability: Mapping[str, Mapping]
    tokenizer: Tokenizer
    family: ModelFamily
    #: (provider, finish reason, own vote) -> the convention judged under: a dataset's few groups are asked for
    #: by every sample, and again by each repair candidate searched
    _group_conventions: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _reasoning_checked(self, st: SampleStats) -> bool:
        """Whether ``st``'s reasoning count is checked: its provider's, learned from the other samples."""
        return reasoning_checked(self.reliability, st.provider, reasoning_vote(st, self.conventions))

    def _billed_reasoning(self, st: SampleStats) -> int | None:
        return st.billed_reasoning if self._reasoning_checked(st) else None

    def _conv(self, st: SampleStats) -> str:
        """The convention ``st`` is judged under: learned from the other samples (its own vote left out)."""
        key = (st.provider, st.finish_reason, count_vote(st))
        conv = self._group_conventions.get(key)
        if conv is None:
            conv = self._group_conventions[key] = convention_for(self.conventions, *key)
        return conv

    def first_verdicts(self, stats: Sequence[SampleStats]) -> list[Judgement]:
        """Each sample under its provider's convention, before any repair."""
        judged = []
        for st in stats:
            conv = self._conv(st)
            v, reasons = verdict(st, conv, self._reasoning_checked(st))
            judged.append(Judgement(v, reasons, st.completion_diff(conv if conv != "unknown" else "counts_eot")))
        return judged

    def repair_behaviours(self, stats: Sequence[SampleStats], judged: Sequence[Judgement],
                          rows: Iterable[tuple[int, tuple]]) -> dict[str, dict[str, int]]:
        """Round 1: which transformations does each provider apply? Evidence = a sample that exactly
        one single transformation explains (only samples needing a repair are searched), and
        :data:`~eagledata.tokens.repairs.KEY_ORDER_KEPT` for a sample whose returned tool-call
        arguments prove it kept the model's key order (:func:`~eagledata.tokens.repairs.shows_key_order_kept`).
        ``rows``: (sample index, (segments, finish_reason)) of every sample. Returns per provider the
        samples evidencing each; the sums over shards are the dataset's (:func:`proven_repairs`)."""
        learned: dict[str, dict[str, int]] = {}
        for i, (segs, finish) in rows:
            st, parsed = stats[i], None
            found: tuple[str, ...] = ()
            if repairable(judged[i].reasons):
                parsed, thinking = _row_parsed(segs, finish), _thinking_of(segs)
                sample = SampleCandidates(parsed)
                singles = [t for t in sample.applicable
                           if search_repairs(sample, self.tokenizer, self.family, st.billed_completion,
                                             self._billed_reasoning(st), self._conv(st), thinking,
                                             only=(t,)).status == "unique"]
                behaviours = {_transform_family(t) for t in singles}
                if len(behaviours) == 1:  # stripping is one behaviour: it may hit reasoning and content alike
                    found = behaviours.pop()
            if '"tool_arguments"' in segs and shows_key_order_kept(parsed or _row_parsed(segs, finish)):
                found += (KEY_ORDER_KEPT,)
            if found:
                counts = learned.setdefault(st.provider, {})
                for t in found:
                    counts[t] = counts.get(t, 0) + 1
        return learned

    def apply_repairs(self, stats: Sequence[SampleStats], judged: Sequence[Judgement],
                      rows: Iterable[tuple[int, tuple]], learned: Mapping[str, Iterable[str]]) -> None:
        """Round 2: each sample needing a repair gets the combinations of its provider's known
        transformations (``learned``: the union of :meth:`repair_behaviours` over the dataset; its
        :data:`~eagledata.tokens.repairs.KEY_ORDER_KEPT` is no transformation, it frees respaced key orders)."""
        for i, (segs, finish) in rows:
            st, j = stats[i], judged[i]
            if repairable(j.reasons):
                proven = set(learned.get(st.provider, ()))
                known = tuple(sorted(proven - {KEY_ORDER_KEPT}))
                if known:
                    self._repair(st, j, SampleCandidates(_row_parsed(segs, finish)), _thinking_of(segs), known,
                                 KEY_ORDER_KEPT in proven)

    def ambiguity_check(self, stats: Sequence[SampleStats], judged: Sequence[Judgement],
                        rows: Iterable[tuple[int, tuple]], learned: Mapping[str, Iterable[str]]) -> None:
        """After round 2: a sample whose counts match as it came (exact, or repaired during
        reconstruction: a rebuilt tool-call id...) and also with a provider transformation undone is
        ambiguous: ``whitespace_ambiguous`` for a provider proven to strip leading spaces and a space
        restored; ``tool_arguments_ambiguous`` for tool arguments that came as compact JSON
        (``tool_arguments_compact``) and the model's spacing, whatever the provider (spacing a
        ``false`` or a ``null`` may cost no token, and one compacting provider bills the spaced text
        while another bills what it returns). Its ids stay the text the provider returned (the
        candidate is evidence, never stored). Samples a repair search already chose for (round 2,
        whose candidates include the restored spaces) are not searched again. Compact arguments whose key
        order a sorting re-serializer could have written are ``tool_arguments_order_unproven`` unless the
        provider is proven to keep key order. The completion's verdict decides, whatever the prompt's
        (the default policy admits a completion with a differing prompt)."""
        strippers = {p for p, ts in learned.items() if set(ts) & {WHITESPACE_REASONING, WHITESPACE_CONTENT}}
        for i, (segs, finish) in rows:
            st, j = stats[i], judged[i]
            # the completion's verdict: a differing prompt (joint verdict mismatch) must not skip the check
            if completion_verdict(j.reasons) not in ("exact", "repaired") or j.repair is not None:
                continue
            checks = [(WHITESPACE_REASONING, WHITESPACE_CONTENT)] if st.provider in strippers else []
            if "tool_arguments_compact" in st.codes:
                checks.append((ARGUMENTS_RESPACED,))
            sample, thinking = (SampleCandidates(_row_parsed(segs, finish)), _thinking_of(segs)) if checks else (None, None)
            for only in checks:
                res = search_repairs(sample, self.tokenizer, self.family, st.billed_completion,
                                     self._billed_reasoning(st), self._conv(st), thinking, only=only)
                if res.status in ("unique", "ambiguous"):
                    j.reasons.append("tool_arguments_ambiguous" if only == (ARGUMENTS_RESPACED,) else "whitespace_ambiguous")
                    j.verdict = verdict_of(j.reasons)
                    j.repair = dataclasses.replace(res, chosen=None)
                    break
            else:  # the arguments as they came
                parsed_of = (lambda: sample.parsed) if sample is not None else (lambda: _row_parsed(segs, finish))
                if _order_unproven(st, parsed_of, KEY_ORDER_KEPT in set(learned.get(st.provider, ()))):
                    j.reasons.append("tool_arguments_order_unproven")
                    j.verdict = verdict_of(j.reasons)

    def _repair(self, st: SampleStats, j: Judgement, sample: SampleCandidates, thinking: bool, known: tuple[str, ...],
                order_kept: bool = False) -> None:
        """Search ``known`` repairs of ``sample``. A unique candidate that respaces tool arguments (the provider
        re-serialized them), or keeps compact ones, is not chosen where their key order is in question
        (``order_kept``: the provider is proven to keep it): it stays evidence, the sample a mismatch
        (``tool_arguments_order_unproven``)."""
        res = search_repairs(sample, self.tokenizer, self.family, st.billed_completion, self._billed_reasoning(st),
                             self._conv(st), thinking, only=known)
        if res.status == "unique" and "tool_arguments_compact" in st.codes and ARGUMENTS_RESPACED not in known:
            # a provider not (yet) proven to compact: the model's spacing may explain the count as well
            wider = search_repairs(sample, self.tokenizer, self.family, st.billed_completion, self._billed_reasoning(st),
                                   self._conv(st), thinking, only=known + (ARGUMENTS_RESPACED,))
            res = wider if wider.status == "ambiguous" else res
        j.repair = res
        if res.status == "unique" and _order_unproven(st, lambda: sample.parsed, order_kept, ARGUMENTS_RESPACED in res.transforms):
            j.repair = dataclasses.replace(res, chosen=None)
            j.reasons.append("tool_arguments_order_unproven")
            j.verdict = verdict_of(j.reasons)
        elif res.status == "unique":
            kept = [c for c in j.reasons if c not in COUNT_CODES]
            j.reasons = kept + [c for c in res.reason_codes if c not in kept]
            j.verdict = verdict_of(j.reasons)
            j.completion_diff = 0
        elif res.status == "ambiguous":
            j.reasons.append("repair_ambiguous")
            j.verdict = verdict_of(j.reasons)


def _order_unproven(st: SampleStats, parsed_of: Callable[[], Any], order_kept: bool, respaced: bool = False) -> bool:
    """Re-serialized arguments (``respaced`` by the chosen repair, or compact as they came) whose key
    order a sorting re-serializer could have written, from a provider not proven to keep key order
    (``order_kept``): the counts cannot prove it. ``parsed_of()`` gives the sample's parsed answer; it is
    asked for only when the arguments were re-serialized (most samples' were not)."""
    return (respaced or "tool_arguments_compact" in st.codes) and key_order_in_question(parsed_of(), order_kept)


#: Samples a transformation needs as evidence before a provider is taken to apply it: one sample is no
#: behaviour of a provider (a billed count off by one or two, a glitch, explains itself through a
#: whitespace prefix, and that sample alone then "repaired" itself with text the model never wrote).
MIN_REPAIR_EVIDENCE = 2


def proven_repairs(evidence: Mapping[str, Mapping[str, int]]) -> dict[str, set[str]]:
    """Per provider, the transformations at least :data:`MIN_REPAIR_EVIDENCE` samples evidence."""
    out = {p: {t for t, n in counts.items() if n >= MIN_REPAIR_EVIDENCE} for p, counts in evidence.items()}
    return {p: ts for p, ts in out.items() if ts}


def _transform_family(transform: str) -> tuple[str, ...]:
    if transform in (WHITESPACE_REASONING, WHITESPACE_CONTENT):
        return (WHITESPACE_REASONING, WHITESPACE_CONTENT)
    return (transform,)


def _shard_rows(out: Path, shard_files: list[str], columns: list[str]) -> Iterator[tuple]:
    for name in shard_files:
        yield from pl.read_parquet(out / name, columns=columns).iter_rows()


def transformations_seen(stats: list[SampleStats], judged: list[Judgement]) -> dict[str, dict[str, int]]:
    seen: dict[str, Counter] = {}
    for st, j in zip(stats, judged):
        c = seen.setdefault(st.provider, Counter())
        for code in j.reasons:
            if REASONS[code][0] == "repair":
                c[code] += 1
    return {p: dict(c) for p, c in seen.items()}
