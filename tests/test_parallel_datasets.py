"""Two datasets whose model keys differ but whose requests are the same (same model slug, same
settings, same prompts), generated at once by ``snakemake --cores 2``: each request is paid once
(cross-dataset request claims, eagledata.generate.carryover.RequestClaims)."""
from __future__ import annotations

import json
import sqlite3

import pytest
import yaml

from conftest import need_shared
from workflow_runs import copy_repo, snakemake

pytestmark = pytest.mark.workflow

KEY = "sk-or-v1-test-secret-0123456789abcdef"


@pytest.mark.parametrize("turns", ["last", "all"])
def test_parallel_jobs_of_two_model_keys_with_the_same_requests_pay_each_request_once(tmp_path, k25, turns):
    from eagledata.standin.server import SimulatorServer

    tok, fam = k25
    tok_dir = need_shared("tokenizers", "kimi-k2.5")
    work = copy_repo(tmp_path / "w")
    prompts = work / "data/p.jsonl"
    prompts.parent.mkdir()
    n = 12
    # turns: all regenerates both user turns of each conversation, the second sent after the first's reply
    messages = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "An answer."},
                 {"role": "user", "content": "And then?"}] for i in range(n)]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": m if turns == "all" else m[:1]}) + "\n"
                               for i, m in enumerate(messages)))
    n = n * (2 if turns == "all" else 1)  # requests
    model = {"family": "kimi-k2.5", "tokenizer": str(tok_dir), "api_model": "moonshotai/kimi-k2.5",
             "price_per_mtok": {"prompt": 0.6, "completion": 2.5}}
    # latency keeps both jobs' requests in flight together
    with SimulatorServer(tok, fam, seed=3, latency_ms=150) as server:
        config = {"budget_usd": 5.0, "models": {"k2.5": model, "kimi": dict(model)},
                  "generation": {"api_base": server.base_url, "max_tokens": 300, "concurrency": 3,
                                 "backoff_base_s": 0.01},
                  "extraction": {"enabled": False},
                  "datasets": {"a": {"prompts": "data/p.jsonl", "model": "k2.5", "backend": "openrouter", "turns": turns},
                               "b": {"prompts": "data/p.jsonl", "model": "kimi", "backend": "openrouter", "turns": turns}}}
        (work / "config/config.yaml").write_text(yaml.safe_dump(config))
        snakemake(work, "results/a/responses.jsonl", "results/b/responses.jsonl", env={"OPENROUTER_API_KEY": KEY})
        paid = sum(server.request_counts.values())
    summaries = {d: json.loads((work / f"results/{d}/generation_summary.json").read_text()) for d in "ab"}
    assert paid == n, (paid, {d: (s["http_requests"], s["carried_over"]) for d, s in summaries.items()})
    assert sum(s["http_requests"] for s in summaries.values()) == n
    # "requested": what a job answered itself, not what it carried from the other job meanwhile
    assert sum(s["requested"] for s in summaries.values()) == n, {d: s["requested"] for d, s in summaries.items()}
    assert sum(sum(s["carried_over"].values()) for s in summaries.values()) == n
    out = {d: [json.loads(line) for line in (work / f"results/{d}/responses.jsonl").read_text().splitlines()] for d in "ab"}
    assert [r["id"] for r in out["a"]] == [r["id"] for r in out["b"]] and len(out["a"]) == n
    db = sqlite3.connect(str(work / ".cache/eagledata/budget.sqlite"))
    try:  # the ledger paid each request once; a reservation given back by a waiting job is settled at 0
        paid_rows = db.execute("SELECT COUNT(*) FROM reservations WHERE state = 'settled' AND cost > 0").fetchone()[0]
        held = db.execute("SELECT COUNT(*) FROM reservations WHERE state != 'settled'").fetchone()[0]
    finally:
        db.close()
    assert (paid_rows, held) == (n, 0)
    for ra, rb in zip(out["a"], out["b"]):  # the one answer paid, in both datasets
        assert (ra["cache_key"], ra["response_raw"]) == (rb["cache_key"], rb["response_raw"])
