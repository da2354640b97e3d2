"""The samples a report shows: the worst ones (:func:`select_worst`), read from the token shards,
and each one's view (counts, reasons with their implicated tokens, the tokens as HTML)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import polars as pl
from markupsafe import Markup

from eagledata.report.highlight import LEVEL_RANK, implicated_tokens, position_kinds, render_tokens, token_units
from eagledata.tokens.checks import REASONS
from eagledata.tokens.shards import read_shards

#: The token-shard columns a report reads for every sample (the full rows only for those shown).
LIGHT_COLUMNS = ["id", "provider", "finish_reason", "verdict", "reasons", "completion_diff", "prompt_diff",
                 "prompt_len", "completion_len", "reasoning_len"]


def anchor(sample_id: str) -> str:
    """HTML id of a sample's section (deterministic, so other reports can link to it)."""
    return "s-" + re.sub(r"[^A-Za-z0-9_-]", lambda m: f".{ord(m.group()):x}.", sample_id)


def _key(row: Mapping[str, Any]) -> tuple:
    tier = 0 if row["verdict"] in ("mismatch", "error") else 1
    cd, pd = row.get("completion_diff"), row.get("prompt_diff")
    return (tier, -(abs(cd) if cd is not None else -1), -abs(pd or 0), row["id"])


def select_worst(rows: Sequence[Mapping[str, Any]], n: int) -> list[str]:
    """Ids of up to ``n`` worst samples (see module doc): the worst example of each reason code
    first, then the worst of each provider, then by rank; returned in rank order."""
    cands = sorted((r for r in rows if r["verdict"] != "exact"), key=_key)
    if n <= 0 or not cands:
        return []
    severity_rank = {"error": 0, "block": 1, "repair": 2, "info": 3}
    codes = sorted({c for r in cands for c in r["reasons"]},
                   key=lambda c: (severity_rank.get(REASONS.get(c, ("info",))[0], 9), c))
    picked: list[str] = []
    for code in codes:
        if len(picked) >= n:
            break
        for r in cands:
            if code in r["reasons"]:
                if r["id"] not in picked:
                    picked.append(r["id"])
                break
    seen_providers: set[str] = set()
    for r in cands:
        if len(picked) >= n:
            break
        if r["provider"] not in seen_providers:
            seen_providers.add(r["provider"])
            if r["id"] not in picked:
                picked.append(r["id"])
    for r in cands:
        if len(picked) >= n:
            break
        if r["id"] not in picked:
            picked.append(r["id"])
    rank = {r["id"]: i for i, r in enumerate(cands)}
    return sorted(picked, key=rank.__getitem__)


def light_frame(tokens_dir: str | Path) -> pl.DataFrame:
    return read_shards(tokens_dir, columns=LIGHT_COLUMNS)


def full_rows(tokens_dir: str | Path, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    if not ids:
        return {}
    d = Path(tokens_dir)
    manifest = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    files = [str(d / s["file"]) for s in manifest["shards"]]
    df = pl.scan_parquet(files).filter(pl.col("id").is_in(list(ids))).collect()
    return {r["id"]: r for r in df.iter_rows(named=True)}


def sample_view(row: Mapping[str, Any], tokenizer, settings: Mapping[str, Any]) -> dict[str, Any]:
    ids = list(row["input_ids"] or [])
    plen = int(row["prompt_len"] or 0)
    completion = ids[plen:]
    segments = json.loads(row["segments"] or "[]")
    rewrites = json.loads(row["tool_id_rewrites"] or "[]")
    repair = json.loads(row.get("repair") or "null")
    units = token_units(completion, tokenizer)
    unit_texts = {p: u.text for u in units for p in range(u.start, u.end)}
    implications = [
        implicated_tokens(code, completion, segments, unit_texts=unit_texts, is_special=tokenizer.is_special_id,
                          decode=tokenizer.decode, completion_diff=row["completion_diff"],
                          prompt_diff=row["prompt_diff"], tool_id_rewrites=rewrites, repair=repair)
        for code in row["reasons"]
    ]
    marks: dict[int, tuple[str, list[str]]] = {}
    for imp in implications:
        if imp.level is None:
            continue
        for p in imp.positions:
            lv, cs = marks.get(p, (imp.level, []))
            if LEVEL_RANK[imp.level] > LEVEL_RANK[lv]:
                lv = imp.level
            marks[p] = (lv, cs + [imp.code])
    kinds = position_kinds(len(completion), segments)
    prompt = ids[:plen]
    tail = prompt[-int(settings["prompt_tail_tokens"]):] if settings["prompt_tail_tokens"] else []
    prompt_html = render_tokens(tail, token_units(tail, tokenizer), ["prompt"] * len(tail), max_tokens=len(tail) + 1) if tail else Markup("")
    return {
        "id": row["id"], "anchor": anchor(row["id"]), "provider": row["provider"], "model": row.get("model"),
        "verdict": row["verdict"], "finish_reason": row["finish_reason"], "status": row.get("status"),
        "counts": [
            ("prompt", plen, row["billed_prompt"], row["prompt_diff"]),
            ("completion", int(row["completion_len"] or 0), row["billed_completion"], row["completion_diff"]),
            ("reasoning", int(row["reasoning_len"] or 0), row["billed_reasoning"], None),
        ],
        "reasons": [{"code": imp.code, "severity": REASONS.get(imp.code, ("info", ""))[0],
                     "message": REASONS.get(imp.code, ("", imp.code))[1], "level": imp.level,
                     "positions": imp.positions, "note": imp.note} for imp in implications],
        "rewrites": rewrites,
        "repair": repair,
        "n_tokens": len(completion),
        "tokens_html": render_tokens(completion, units, kinds, marks, max_tokens=int(settings["max_tokens_shown"])),
        "prompt_html": prompt_html, "prompt_shown": len(tail), "prompt_len": plen,
    }
