"""The product's promise, checked against ground truth: for every provider behaviour the stand-in
reproduces, no sample is called exact or repaired unless its ids equal the ids the model produced."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from eagledata.families import get_family
from eagledata.simulator import PROFILES, CompletionModel, SimulatorServer
from eagledata.tokenizer import load_tokenizer
from eagledata.tokens import build_token_shards, read_shards

ROOT = Path(__file__).resolve().parents[1]
SEED = 11

#: What each stand-in provider profile must end as (beyond "never wrongly exact").
EXPECTED = {
    "exact": {"exact"},
    "no-eot": {"exact"},
    "call-ids": {"exact", "repaired"},
    "markup-in-content": {"exact", "repaired"},
    "strip-whitespace": {"exact", "repaired", "mismatch"},
    "drop-reasoning": {"mismatch"},
}


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    from eagledata.demo_tokenizer import build_demo_tokenizer, default_corpus_path

    out = tmp_path_factory.mktemp("tok") / "demo"
    build_demo_tokenizer(default_corpus_path(), out)
    fam = get_family("kimi-k2.5")
    return load_tokenizer(out, fam), fam


def _prompts():
    rows = []
    for name in ("chat", "tools"):
        for line in (ROOT / f"config/demo/{name}.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_verdicts_never_bless_wrong_ids(profile, demo_tok, tmp_path):
    tok, fam = demo_tok
    records = []
    with SimulatorServer(tok, fam, seed=SEED, profile=profile) as sim, httpx.Client(timeout=30) as client:
        for i, p in enumerate(_prompts()):
            body = {"model": "demo", "messages": p["messages"], "max_tokens": 4096, "stream": i % 2 == 1}
            if p.get("tools"):
                body["tools"] = p["tools"]
            r = client.post(sim.base_url + "/chat/completions", json=body)
            records.append({"id": p["id"], "request": body, "status": r.status_code, "response_raw": r.text})
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    build_token_shards(path, tmp_path / "tokens", tok, fam, profile, shard_size=16)
    rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
    truth_model = CompletionModel(tok, fam, SEED)
    verdicts = set()
    for rec in records:
        row = rows[rec["id"]]
        truth = truth_model.complete(rec["request"])
        verdicts.add(row["verdict"])
        if row["verdict"] in ("exact", "repaired"):
            assert row["input_ids"] == truth.prompt_ids + truth.ids, (profile, rec["id"], row["reasons"])
    assert verdicts <= EXPECTED.get(profile, {"exact", "repaired", "mismatch"}), (profile, verdicts)
    if profile in ("exact", "no-eot"):
        assert verdicts == {"exact"}
