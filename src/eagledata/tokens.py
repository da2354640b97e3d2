"""Token stage: a dataset's responses file -> Parquet token shards with verdicts, plus a manifest.

Each shard holds ``shard_size`` samples (one row per response record, in file order), with columns:
``id``, ``provider``, ``model``, ``finish_reason``, ``status``, ``input_ids`` (prompt + completion,
int64), ``prompt_len``, ``completion_len``, ``reasoning_len``, ``billed_prompt``,
``billed_completion``, ``billed_reasoning``, ``completion_diff`` (ours minus billed under the
provider's convention), ``prompt_diff``, ``flags`` (reconstruction flags), ``verdict``, ``reasons``,
``train`` (the dataset's policy admits the sample), ``segments`` and ``tool_id_rewrites`` (JSON),
``cost``. ``manifest.json`` lists shards with row counts and sha256, the tokenizer fingerprint, the
learned provider conventions and the policy.

Two passes keep memory flat: shards are written as samples are reconstructed; verdicts need every
sample's counts (to learn each provider's convention), so a second pass adds them to each shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import polars as pl

from .checks import POLICIES, SampleStats, learn_conventions, sample_stats, verdict
from .families import ModelFamily
from .samples import record_id, tokenize_record
from .tokenizer import Tokenizer

SHARD_NAME = "shard-{:05d}.parquet"


class ResponsesFileError(ValueError):
    pass


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) of a responses JSONL; bad lines raise naming file:line:field."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ResponsesFileError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(rec, dict):
                raise ResponsesFileError(f"{path}:{lineno}: a record must be a JSON object")
            for key in ("request", "response_raw"):
                if key not in rec:
                    raise ResponsesFileError(f"{path}:{lineno}: field '{key}' is missing")
            if not isinstance(rec["request"], dict):
                raise ResponsesFileError(f"{path}:{lineno}: field 'request' must be an object")
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
    policy: str = "exact+repaired",
    template: str | None = None,
) -> TokenStageResult:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    admitted = POLICIES[policy]
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
    shards_meta = []
    i = 0
    for name in shard_files:
        df = pl.read_parquet(out / name)
        extra: dict[str, list] = {"completion_diff": [], "prompt_diff": [], "verdict": [], "reasons": [], "train": []}
        for _ in range(df.height):
            st = all_stats[i]
            conv = conventions[st.provider]["convention"]
            v, reasons = verdict(st, conv)
            extra["completion_diff"].append(st.completion_diff(conv if conv != "unknown" else "counts_eot"))
            extra["prompt_diff"].append(st.prompt_diff)
            extra["verdict"].append(v)
            extra["reasons"].append(reasons)
            extra["train"].append(v in admitted)
            i += 1
        df = df.with_columns(
            pl.Series("completion_diff", extra["completion_diff"], dtype=pl.Int64),
            pl.Series("prompt_diff", extra["prompt_diff"], dtype=pl.Int64),
            pl.Series("verdict", extra["verdict"], dtype=pl.Utf8),
            pl.Series("reasons", extra["reasons"], dtype=pl.List(pl.Utf8)),
            pl.Series("train", extra["train"], dtype=pl.Boolean),
        )
        _atomic_parquet(df, out / name)
        shards_meta.append({"file": name, "rows": df.height, "sha256": sha256_file(out / name)})

    manifest = {
        "dataset": dataset,
        "source": str(responses_path),
        "source_sha256": sha256_file(responses_path),
        "tokenizer": tokenizer.source,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "family": family.name,
        "policy": policy,
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
