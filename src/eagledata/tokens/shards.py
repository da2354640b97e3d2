"""Token stage: a dataset's responses file -> Parquet token shards with verdicts, plus a manifest.

Each shard holds ``shard_size`` samples (one row per response record, in file order), with columns:
``id``, ``provider``, ``model``, ``finish_reason``, ``status``, ``input_ids`` (prompt + completion,
int64), ``prompt_len``, ``completion_len``, ``reasoning_len``, ``billed_prompt``,
``billed_completion``, ``billed_reasoning``, ``completion_diff`` (ours minus billed under the
provider's convention), ``prompt_diff``, ``flags`` (reconstruction flags), ``verdict`` (both sides
together: a differing prompt makes it ``mismatch``), ``completion_verdict`` (exact | repaired |
mismatch | error), ``prompt_verdict`` (exact | differs | unbilled | error), ``prompt_variant`` (the
provider's learned rendering variant explaining a differing prompt, else null), ``reasons``,
``train`` (the dataset's policy admits the sample, see :mod:`eagledata.tokens.policy`), ``segments`` and
``tool_id_rewrites`` (JSON), ``repair`` (evidence, JSON), ``cost``. ``manifest.json`` lists shards
with row counts and sha256, the tokenizer fingerprint, the policy and what was learned per
provider: count conventions, reasoning count reliability and prompt rendering variants.

Two passes keep memory flat: shards are written as samples are reconstructed; verdicts need every
sample's counts (to learn each provider's convention), so a second pass adds them to each shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import polars as pl

from eagledata.tokens.checks import (COUNT_CODES, REASONS, SampleStats, completion_verdict, convention_for, learn_conventions,
                     prompt_verdict, repairable, sample_stats, verdict, verdict_of)
from eagledata.tokens.learning import learn_prompt_variants, learn_reasoning_reliability, reasoning_checked, sample_variant
from eagledata.tokens.policy import Policy, resolve_policy
from eagledata.tokens.repairs import (WHITESPACE_CONTENT, WHITESPACE_REASONING, RepairResult, applicable_transforms,
                      parsed_from_segments, search_repairs)
from eagledata.text.families import ModelFamily
from eagledata.io import ResponsesFileError, iter_json_lines, normalize_response_line
from eagledata.tokens.samples import alternative_prompt_lengths, record_id, tokenize_record
from eagledata.text.tokenizer import Tokenizer

SHARD_NAME = "shard-{:05d}.parquet"


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) of a responses JSONL (any shape :func:`normalize_response_line`
    accepts); bad lines raise naming file:line:field."""
    for lineno, where, rec in iter_json_lines(path, ResponsesFileError, "responses file"):
        rec = normalize_response_line(rec)
        for key in ("request", "response_raw"):
            if key not in rec:
                raise ResponsesFileError(f"{where}:{key}: missing")
        if not isinstance(rec["request"], dict):
            raise ResponsesFileError(f"{where}:request: must be an object")
        yield lineno, rec


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_parquet(df: pl.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.write_parquet(tmp, compression="zstd")
    os.replace(tmp, path)


@dataclass
class TokenStageResult:
    manifest: dict[str, Any]
    stats: list[SampleStats]


def build_token_shards(
    responses_path: str | Path,
    out_dir: str | Path,
    tokenizer: Tokenizer,
    family: ModelFamily,
    dataset: str,
    shard_size: int = 1000,
    policy: str | Mapping[str, Any] | Policy = "default",
    template: str | None = None,
) -> TokenStageResult:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    admitted = resolve_policy(policy)
    all_stats: list[SampleStats] = []
    rows: list[dict[str, Any]] = []
    shard_files: list[str] = []
    seen: set[str] = set()

    def flush() -> None:
        name = SHARD_NAME.format(len(shard_files))
        _atomic_parquet(pl.DataFrame(rows, schema=_PASS1_SCHEMA), out / name)
        shard_files.append(name)
        rows.clear()

    for lineno, rec in iter_records(responses_path):
        sid = record_id(rec, f"{dataset}-{lineno:06d}")
        if sid in seen:
            raise ResponsesFileError(f"{responses_path}:{lineno}: field 'id': duplicate id {sid!r}")
        seen.add(sid)
        sample = tokenize_record(rec, tokenizer, family, sid, template)
        st = sample_stats(sample, tokenizer, family)
        if st.prompt_diff and st.has_tools:
            st.prompt_alt = alternative_prompt_lengths(sample, tokenizer, template)
        all_stats.append(st)
        p = sample.parsed
        rows.append({
            "id": sid, "provider": st.provider, "model": p.model, "finish_reason": p.finish_reason,
            "status": int(rec.get("status") or 0), "input_ids": sample.input_ids,
            "prompt_len": st.prompt_len, "completion_len": st.completion_len, "reasoning_len": st.reasoning_len,
            "billed_prompt": st.billed_prompt, "billed_completion": st.billed_completion,
            "billed_reasoning": st.billed_reasoning, "flags": sample.completion.flags,
            "segments": json.dumps([s.to_dict() for s in sample.completion.segments], ensure_ascii=False),
            "tool_id_rewrites": json.dumps(sample.completion.tool_id_rewrites, ensure_ascii=False),
            "cost": p.cost,
        })
        if len(rows) >= shard_size:
            flush()
    if rows or not shard_files:
        flush()

    conventions = learn_conventions(all_stats)
    reliability = learn_reasoning_reliability(all_stats, conventions)
    variants = learn_prompt_variants(all_stats)
    judged = _judge(out, shard_files, all_stats, conventions, tokenizer, family, reliability)
    shards_meta = []
    i = 0
    for name in shard_files:
        df = pl.read_parquet(out / name)
        cols: dict[str, list] = {k: [] for k in ("completion_diff", "prompt_diff", "verdict", "completion_verdict",
                                                 "prompt_verdict", "prompt_variant", "reasons", "train", "repair")}
        input_ids = df["input_ids"].to_list()
        segments = df["segments"].to_list()
        completion_len = df["completion_len"].to_list()
        reasoning_len = df["reasoning_len"].to_list()
        for row in range(df.height):
            st, j = all_stats[i], judged[i]
            if j.repair is not None and j.repair.chosen is not None:
                rc = j.repair.chosen
                input_ids[row] = input_ids[row][: st.prompt_len] + rc.ids
                segments[row] = json.dumps([seg.to_dict() for seg in rc.segments], ensure_ascii=False)
                completion_len[row], reasoning_len[row] = len(rc.ids), rc.reasoning_tokens
            cols["completion_diff"].append(j.completion_diff)
            cols["prompt_diff"].append(st.prompt_diff)
            c_verdict, p_verdict = completion_verdict(j.reasons), prompt_verdict(st)
            cols["verdict"].append(j.verdict)
            cols["completion_verdict"].append(c_verdict)
            cols["prompt_verdict"].append(p_verdict)
            cols["prompt_variant"].append(sample_variant(variants, st))
            cols["reasons"].append(j.reasons)
            cols["train"].append(admitted.admits(c_verdict, p_verdict))
            cols["repair"].append(json.dumps(j.evidence) if j.evidence else None)
            i += 1
        df = df.with_columns(
            pl.Series("input_ids", input_ids, dtype=pl.List(pl.Int64)),
            pl.Series("segments", segments, dtype=pl.Utf8),
            pl.Series("completion_len", completion_len, dtype=pl.Int32),
            pl.Series("reasoning_len", reasoning_len, dtype=pl.Int32),
            pl.Series("completion_diff", cols["completion_diff"], dtype=pl.Int64),
            pl.Series("prompt_diff", cols["prompt_diff"], dtype=pl.Int64),
            pl.Series("verdict", cols["verdict"], dtype=pl.Utf8),
            pl.Series("completion_verdict", cols["completion_verdict"], dtype=pl.Utf8),
            pl.Series("prompt_verdict", cols["prompt_verdict"], dtype=pl.Utf8),
            pl.Series("prompt_variant", cols["prompt_variant"], dtype=pl.Utf8),
            pl.Series("reasons", cols["reasons"], dtype=pl.List(pl.Utf8)),
            pl.Series("train", cols["train"], dtype=pl.Boolean),
            pl.Series("repair", cols["repair"], dtype=pl.Utf8),
        )
        _atomic_parquet(df, out / name)
        shards_meta.append({"file": name, "rows": df.height, "sha256": sha256_file(out / name)})
    for provider, seen in _transformations_seen(all_stats, judged).items():
        conventions[provider]["transformations_seen"] = seen
    for provider, r in reliability.items():
        conventions[provider]["reasoning_count"] = r
    for provider, v in variants.items():
        conventions[provider]["prompt_rendering"] = v

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
        "rows": len(all_stats),
        "shards": shards_meta,
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "manifest.json")
    return TokenStageResult(manifest, all_stats)


_PASS1_SCHEMA: Mapping[str, Any] = {
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
    return parsed_from_segments(json.loads(segments_json), finish_reason)


def _thinking_of(segments_json: str) -> bool:
    kinds = {seg["kind"] for seg in json.loads(segments_json)}
    return bool(kinds & {"reasoning", "think_close", "think_open"})


def _judge(out: Path, shard_files: list[str], stats: list[SampleStats], conventions: dict[str, dict],
           tokenizer: Tokenizer, family: ModelFamily, reliability: Mapping[str, Mapping] | None = None) -> list[Judgement]:
    """Verdicts for every sample. Count mismatches get a repair search; a provider proven to strip
    leading spaces (a unique whitespace repair somewhere in the dataset) makes its exact samples
    that would also match with a space restored ambiguous. A provider whose reasoning count is not a
    checksum (``reliability``) is judged, and its repairs searched, on the completion total alone."""
    reliability = reliability or {}

    def billed_reasoning(st: SampleStats) -> int | None:
        return st.billed_reasoning if reasoning_checked(reliability, st.provider) else None

    judged: list[Judgement] = []
    for st in stats:
        conv = convention_for(conventions, st.provider, st.finish_reason)
        v, reasons = verdict(st, conv, reasoning_checked(reliability, st.provider))
        judged.append(Judgement(v, reasons, st.completion_diff(conv if conv != "unknown" else "counts_eot")))
    need_repair = {i for i, j in enumerate(judged) if repairable(j.reasons)}
    # Round 1: which transformations does each provider apply? Evidence = a sample that exactly one
    # single transformation explains.
    learned: dict[str, set[str]] = {}
    candidates: dict[int, tuple] = {}
    for i, (segs, finish) in enumerate(_shard_rows(out, shard_files, ["segments", "finish_reason"])):
        if i not in need_repair:
            continue
        st = stats[i]
        conv = convention_for(conventions, st.provider, st.finish_reason)
        parsed, thinking = _row_parsed(segs, finish), _thinking_of(segs)
        candidates[i] = (parsed, thinking)
        singles = [t for t in applicable_transforms(parsed)
                   if search_repairs(parsed, tokenizer, family, st.billed_completion, billed_reasoning(st), conv,
                                     thinking, only=(t,)).status == "unique"]
        behaviours = {_transform_family(t) for t in singles}
        if len(behaviours) == 1:  # stripping is one behaviour: it may hit reasoning and content alike
            learned.setdefault(st.provider, set()).update(behaviours.pop())
    # Round 2: each sample's candidates are the combinations of its provider's known transformations.
    for i, (parsed, thinking) in candidates.items():
        st = stats[i]
        known = tuple(sorted(learned.get(st.provider, ())))
        if not known:
            continue
        res = search_repairs(parsed, tokenizer, family, st.billed_completion, billed_reasoning(st),
                             convention_for(conventions, st.provider, st.finish_reason), thinking, only=known)
        j = judged[i]
        j.repair = res
        if res.status == "unique":
            kept = [c for c in j.reasons if c not in COUNT_CODES]
            j.reasons = kept + [c for c in res.reason_codes if c not in kept]
            j.verdict = verdict_of(j.reasons)
            j.completion_diff = 0
        elif res.status == "ambiguous":
            j.reasons.append("repair_ambiguous")
            j.verdict = verdict_of(j.reasons)
    strippers = {p for p, ts in learned.items() if ts & {WHITESPACE_REASONING, WHITESPACE_CONTENT}}
    if strippers:
        need_ws_check = {i for i, j in enumerate(judged) if j.verdict == "exact" and stats[i].provider in strippers}
        for i, (segs, finish) in enumerate(_shard_rows(out, shard_files, ["segments", "finish_reason"])):
            if i not in need_ws_check:
                continue
            st = stats[i]
            res = search_repairs(_row_parsed(segs, finish), tokenizer, family, st.billed_completion, billed_reasoning(st),
                                 convention_for(conventions, st.provider, st.finish_reason), _thinking_of(segs),
                                 only=(WHITESPACE_REASONING, WHITESPACE_CONTENT))
            if res.status in ("unique", "ambiguous"):
                judged[i].reasons.append("whitespace_ambiguous")
                judged[i].verdict = verdict_of(judged[i].reasons)
                judged[i].repair = res
    return judged


def _transform_family(transform: str) -> tuple[str, ...]:
    if transform in (WHITESPACE_REASONING, WHITESPACE_CONTENT):
        return (WHITESPACE_REASONING, WHITESPACE_CONTENT)
    return (transform,)


def _shard_rows(out: Path, shard_files: list[str], columns: list[str]) -> Iterator[tuple]:
    for name in shard_files:
        yield from pl.read_parquet(out / name, columns=columns).iter_rows()


def _transformations_seen(stats: list[SampleStats], judged: list[Judgement]) -> dict[str, dict[str, int]]:
    seen: dict[str, Counter] = {}
    for st, j in zip(stats, judged):
        c = seen.setdefault(st.provider, Counter())
        for code in j.reasons:
            if REASONS[code][0] == "repair":
                c[code] += 1
    return {p: dict(c) for p, c in seen.items()}
