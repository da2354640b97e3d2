"""The budget ledger: reservations against global and per-dataset caps, settlement, orphans of dead
processes and their reconciliation, two generate processes with 256 requests in flight each sharing
one ledger, and the plan/budget commands; accounts (real money apart from the stand-in's), jobs on
other machines and namespaces, answers arriving after their reservation was reconciled."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eagledata.generate.budget import BudgetExhausted, BudgetLedger, LedgerBusy, Reserve, ledger_path
from eagledata.generate.ledgersession import LedgerSession
from eagledata.cli import main as cli_main
from eagledata.generate.errors import JobStopped
from eagledata.generate.job import generate_dataset
from eagledata.generate.openrouter import key_usage, reconcile_generations
from eagledata.standin.server import SimulatorServer
from gen_helpers import API_KEY, generate_cmd, make_config, quiet, read_jsonl, spawn, write_prompts


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


def reserve(ledger: BudgetLedger, ref: str, amount: float, dataset: str = "a", cap: float | None = 1.0,
            ds_cap: float | None = None):
    return ledger.apply([Reserve(ref, dataset, amount, cap, ds_cap)], [])[0]


def reserve_outcome(led: BudgetLedger, amount: float, timeout: float, dataset: str = "d", cap: float | None = 1.0,
                    ds_cap: float | None = None, **session: Any) -> str:
    """What a job's request for ``amount`` meets within ``timeout`` s: "granted", the
    BudgetExhausted message, or "still waiting"."""
    async def ask() -> str:
        s = LedgerSession(led, dataset, cap, ds_cap, **session)
        try:
            await asyncio.wait_for(s.reserve(amount), timeout)
            return "granted"
        except BudgetExhausted as exc:
            return str(exc)
        except asyncio.TimeoutError:
            return "still waiting"
        finally:
            await s.close()

    return asyncio.run(ask())


def hold_write_lock(path, seconds: float) -> subprocess.Popen:
    """Another process that holds the ledger's write lock for ``seconds`` (returns once it holds it)."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, time\n"
        f"db = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
        f"db.execute('BEGIN IMMEDIATE'); print('locked', flush=True); time.sleep({seconds}); db.execute('COMMIT')\n")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_reserve_settle_and_caps(tmp_path):
    led = BudgetLedger(tmp_path / "b.sqlite")
    assert reserve(led, "r1", 0.6).granted
    d = reserve(led, "r2", 0.5)
    assert not d.granted and "budget_usd 1" in d.reason and d.others_in_flight == 0
    led.apply([], [("settle", "r1", {"cost": 0.1, "provider": "P"})])  # settles below its worst case: frees budget
    assert reserve(led, "r2", 0.5).granted
    assert led.totals() == {"a": {"spent": pytest.approx(0.1), "held": pytest.approx(0.5)}}
    d = reserve(led, "r3", 0.2, dataset="b", ds_cap=0.1)
    assert not d.granted and "datasets.b.budget_usd 0.1" in d.reason
    led.apply([], [("orphan", "r2", {"note": "timeout"})])  # the answer was lost: still counted
    assert not reserve(led, "r4", 0.5).granted
    assert [r["ref"] for r in led.orphans()] == ["r2"]
    report = {(r["dataset"], r["provider"]): r for r in led.report()}
    assert report[("a", "P")]["spent_usd"] == pytest.approx(0.1) and report[("a", "(pending)")]["orphaned_usd"] == 0.5
    assert led.release_orphans() == 1 and led.totals()["a"]["held"] == pytest.approx(0.0)
    led.close()


def test_dead_process_reservations_are_orphaned_then_recovered(tmp_path):
    path = tmp_path / "b.sqlite"
    code = ("import os, sys; from eagledata.generate.budget import BudgetLedger, Reserve; l = BudgetLedger(sys.argv[1]); "
            "[l.apply([Reserve(r, 'a', 0.25, 1.0, None)], []) for r in ('x1', 'x2')]; os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    led = BudgetLedger(path)
    d = reserve(led, "r1", 0.6)  # the dead process's 0.5 is still held
    assert not d.granted and d.others_in_flight == 0  # ... as orphans, not as requests in flight
    assert sorted(r["ref"] for r in led.orphans()) == ["x1", "x2"]
    out = led.recover("a", {"x1": {"cost": 0.05, "provider": "P", "generation_id": "gen-1"}})
    assert out["recovered"] == 1 and [r["ref"] for r in led.orphans()] == ["x2"]
    assert led.totals()["a"] == {"spent": pytest.approx(0.05), "held": pytest.approx(0.25)}
    led.close()


def test_reconcile_from_generation_and_key_usage(tmp_path, k25):
    tok, fam = k25
    with SimulatorServer(tok, fam, seed=1) as sim:
        import httpx

        bodies = [{"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 50} for i in range(3)]
        gens = [httpx.post(sim.base_url + "/chat/completions", json=b).json()["id"] for b in bodies]
        led = BudgetLedger(tmp_path / "b.sqlite")
        led.add_key_snapshot(sim.base_url, 0.0)
        for i, g in enumerate(gens):
            reserve(led, f"r{i}", 0.01)
            fields = {"api_base": sim.base_url, **({"generation_id": g} if i < 2 else {})}
            led.apply([], [("note", f"r{i}", fields), ("orphan", f"r{i}", {})])
        out = asyncio.run(reconcile_generations(led, sim.base_url, {}))
        assert out == {"checked": 2, "settled": 2, "unknown": 0}
        billed = [sim.generations[g].billed for g in gens]
        assert led.totals()["a"]["spent"] == pytest.approx(billed[0] + billed[1])
        usage = asyncio.run(key_usage(sim.base_url, {}))
        assert usage == pytest.approx(sim.billed_usd)
        # a rehearsal on the stand-in shares the ledger: its simulated costs were never the key's
        led.apply([Reserve("sim-0", "rehearse", 0.2, 100, None, {"backend": "simulator", "api_base": None})], [])
        led.apply([], [("settle", "sim-0", {"cost": 0.15})])
        res = led.reconcile_by_key_usage(sim.base_url, usage)  # the unexplained rest is the orphan's
        assert res["settled"] == 1 and led.totals()["a"]["spent"] == pytest.approx(sum(billed))
        assert led.totals()["a"]["held"] == pytest.approx(0.0)
        led.close()


def test_session_waits_for_settlements_then_stops(tmp_path):
    """A reservation that does not fit waits while requests in flight may settle below their worst
    case; with nothing in flight it fails with the cap and the amounts."""
    led = BudgetLedger(tmp_path / "b.sqlite")
    events: list[str] = []

    async def run() -> None:
        s = LedgerSession(led, "a", 1.0, None)
        r1 = await s.reserve(0.6)

        async def second() -> None:
            r2 = await s.reserve(0.6)  # does not fit while r1 holds 0.6
            events.append("granted")
            s.settle(r2, 0.6)

        t = asyncio.create_task(second())
        await asyncio.sleep(0.05)
        events.append("settling")
        s.settle(r1, 0.1)  # frees 0.5
        await t
        with pytest.raises(BudgetExhausted, match=r"budget_usd 1: spent \$0.7000"):
            await s.reserve(0.5)
        await s.close()

    asyncio.run(run())
    assert events == ["settling", "granted"]
    led.close()


def test_budget_never_exceeded_two_datasets_in_parallel_256_in_flight(tmp_path, k25):
    """Two generate processes (two datasets) with 256 requests in flight each share one ledger:
    the stand-in never bills more than budget_usd, and the budget is used, not left idle."""
    tok, fam = k25
    price = {"prompt": 1.0, "completion": 10.0}
    n = 320
    with SimulatorServer(tok, fam, seed=5, latency_ms=400, price_per_mtok=price) as sim:
        cfg = make_config(tmp_path, tmp_path / "unused", tok.source, api_base=sim.base_url, max_tokens=40,
                          concurrency=256, timeout_s=60)
        cfg["models"]["m"]["price_per_mtok"] = price
        cfg["budget_usd"] = 0.25
        cfg["datasets"] = {ds: {"prompts": str(write_prompts(tmp_path / f"{ds}.jsonl", n, tools_every=0, prefix=ds)),
                                "model": "m", "backend": "openrouter"} for ds in ("a", "b")}
        procs = [spawn(generate_cmd(cfg, tmp_path, ds, name=f"cfg-{ds}"), tmp_path / f"{ds}.log") for ds in ("a", "b")]
        codes = [p.wait(120) for p in procs]
        logs = [(tmp_path / f"{ds}.log").read_text() for ds in ("a", "b")]
        assert set(codes) <= {0, 1} and 1 in codes, logs
        assert all(c == 0 or "stopped: budget" in log for c, log in zip(codes, logs)), logs
        assert sim.billed_usd <= cfg["budget_usd"] + 1e-9
        assert sim.billed_usd >= 0.6 * cfg["budget_usd"]  # it spent most of it
        assert sim.max_in_flight > 256  # both jobs had their hundreds of requests in flight at once
        led = BudgetLedger(ledger_path(cfg["cache_dir"]))
        totals = led.totals()
        assert sum(t["spent"] for t in totals.values()) == pytest.approx(sim.billed_usd)
        assert sum(t["held"] for t in totals.values()) == pytest.approx(0.0, abs=1e-12)
        led.close()
        cached = sum(len(read_jsonl(tmp_path / "cache" / ds / "responses.jsonl")) for ds in ("a", "b"))
        assert cached == sim.requests_total  # every paid response is cached


def test_plan_and_budget_commands(tmp_path, k25, capsys, monkeypatch):
    tok, _ = k25
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    with SimulatorServer(tok, k25[1], seed=2) as sim:
        cfg = make_config(tmp_path, prompts, tok.source, api_base=sim.base_url, max_tokens=100)
        cfg["budget_usd"] = 2.0
        cfg["results_dir"] = str(tmp_path / "results")
        cfg_path = tmp_path / "c.yaml"
        generate_cmd(cfg, tmp_path, name="c")  # writes c.yaml
        assert cli_main(["plan", "--config", str(cfg_path), "--json"]) == 0
        p = json.loads(capsys.readouterr().out)
        row = p["datasets"][0]
        assert (row["samples"], row["cached"], row["to_request"]) == (6, 0, 6)
        assert 0 < row["cost_low"] < row["cost_worst"] and row["prompt_estimate"] == "chat template"
        assert sim.requests_total == 0  # planning sends nothing
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
        cfg["generation"]["max_tokens"] = 120
        cfg_path.write_text(json.dumps(cfg))
        assert cli_main(["plan", "--config", str(cfg_path)]) == 0
        text = capsys.readouterr().out
        assert "d " in text and "budget_usd 2: spent $" in text
        cfg["generation"]["max_tokens"] = 100
        cfg_path.write_text(json.dumps(cfg))
        assert cli_main(["plan", "--config", str(cfg_path), "--json"]) == 0
        p = json.loads(capsys.readouterr().out)
        assert (p["datasets"][0]["cached"], p["datasets"][0]["to_request"]) == (6, 0)
        assert p["spent_usd"] == pytest.approx(sim.billed_usd)
        # the dry run cannot list shard jobs before the token plan (a checkpoint) is current: said
        token_plan = Path(p["datasets"][0]["token_plan"])
        assert p["datasets"][0]["shard_jobs_known"] is False
        token_plan.parent.mkdir(parents=True)
        (token_plan.parent.parent / "responses.jsonl").write_text("")
        token_plan.write_text("{}")
        assert cli_main(["plan", "--config", str(cfg_path)]) == 0
        assert "lists none of its token_shard" not in capsys.readouterr().out
        os.utime(token_plan, ns=(1, 1))  # older than the responses
        assert cli_main(["plan", "--config", str(cfg_path)]) == 0
        assert f"d: `snakemake -n` lists none of its token_shard and extract_shard jobs until its token plan is " \
               f"rewritten (a checkpoint): `snakemake {token_plan}`" in capsys.readouterr().out
        assert cli_main(["budget", "--config", str(cfg_path), "--json"]) == 0
        b = json.loads(capsys.readouterr().out)
        assert [(r["dataset"], r["provider"], r["attempts"]) for r in b["rows"]] == [("d", "Simulator", 6)]
        assert b["totals"]["d"]["spent"] == pytest.approx(sim.billed_usd)
        assert cli_main(["budget", "--config", str(cfg_path)]) == 0
        assert "remaining $" in capsys.readouterr().out
        # a prompts file generation would refuse: the plan says so, naming its line, and exits 1
        prompts.write_text(prompts.read_text() + '{"id": "x", "messages": "not a list"}\n')
        assert cli_main(["plan", "--config", str(cfg_path)]) == 1
        assert f"bad input, generation would refuse it: {prompts}:7:" in capsys.readouterr().out
        prompts.write_text("")
        assert cli_main(["plan", "--config", str(cfg_path)]) == 1
        assert "no prompts (file is empty or blank)" in capsys.readouterr().out


def _open_ledger(path):
    from eagledata.generate.budget import BudgetLedger

    BudgetLedger(path).close()


def test_jobs_starting_together_all_open_a_new_ledger(tmp_path):
    """Parallel generate jobs race to create the ledger and switch it to WAL; none may fail."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for k in range(40):  # the race is rare: without the retry about one round in 25 failed
        procs = [ctx.Process(target=_open_ledger, args=(str(tmp_path / f"l{k}.sqlite"),)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 6, k


def test_reservations_asked_ahead_never_wait_and_unused_ones_are_given_back(tmp_path):
    """``reserve_ahead`` is granted only when it fits at once with the cap at most half used (else
    ``None``, nothing held); a granted one that is never used, or whose asker is cancelled, is settled at 0 (not sent), so it
    frees its budget and is not left as an orphan."""
    led = BudgetLedger(tmp_path / "b.sqlite")

    async def run() -> None:
        s = LedgerSession(led, "a", 1.0, None)
        r1 = await s.reserve(0.6)
        assert await s.reserve_ahead(0.5) is None  # does not fit now: no wait, nothing held
        s.settle(r1, 0.2)
        assert await s.reserve_ahead(0.31) is None  # would fill the cap past half (0.2 + 0.31)
        ahead = s.reserve_ahead(0.3)
        ref = await ahead
        assert ref is not None and led.totals()["a"]["held"] == pytest.approx(0.3)
        s.give_back(ahead)
        cancelled = s.reserve_ahead(0.05)
        s.give_back(cancelled)  # not decided yet: cancelled, settled at 0 when the grant comes
        await s.close()

    asyncio.run(run())
    rows = led.db.execute("SELECT state, reserved, cost, note FROM reservations ORDER BY created").fetchall()
    assert [r[0] for r in rows] == ["settled"] * 3
    assert [r[2] for r in rows] == [pytest.approx(0.2), 0.0, 0.0]
    assert all("not sent" in r[3] for r in rows[1:])
    assert led.totals()["a"] == {"spent": pytest.approx(0.2), "held": pytest.approx(0.0)}
    assert led.orphans() == []
    led.close()


def test_session_uses_the_background_thread_while_another_process_holds_the_lock(tmp_path):
    """With the write lock free a batch is applied on the event loop's thread; while another
    process holds it, on the session's thread, and the loop keeps running meanwhile."""
    path = tmp_path / "b.sqlite"
    led = BudgetLedger(path)
    holder = hold_write_lock(path, 0.6)
    try:
        with pytest.raises(LedgerBusy, match="locked"):  # the no-wait path gives up at once ...
            led.apply([Reserve("x", "a", 0.1, 1.0, None)], [], wait=False)
        assert led.db.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0  # ... changing nothing

        ticks = []

        async def run() -> str:
            s = LedgerSession(led, "a", 1.0, None)

            async def tick() -> None:
                while True:
                    ticks.append(1)
                    await asyncio.sleep(0.02)

            t = asyncio.create_task(tick())
            ref = await s.reserve(0.1)  # waits for the lock on the thread
            t.cancel()
            s.settle(ref, 0.1)
            await s.close()
            return ref

        asyncio.run(run())
        assert len(ticks) >= 10  # the loop ran while the reservation waited for the lock
    finally:
        holder.wait(10)
    assert led.totals()["a"] == {"spent": pytest.approx(0.1), "held": pytest.approx(0.0)}
    led.close()


def test_note_and_settlement_of_one_reservation_in_one_batch(tmp_path):
    """The note is moot (not written) when the settlement carries the same id; the id is kept."""
    led = BudgetLedger(tmp_path / "b.sqlite")
    led.apply([Reserve("r1", "a", 0.5, 1.0, None), Reserve("r2", "a", 0.1, 1.0, None)], [])
    led.apply([], [("note", "r1", {"generation_id": "g1"}), ("settle", "r1", {"cost": 0.1, "generation_id": "g1"}),
                   ("note", "r2", {"generation_id": "g2"})])
    rows = dict(led.db.execute("SELECT ref, generation_id FROM reservations").fetchall())
    assert rows == {"r1": "g1", "r2": "g2"}  # the kept note and the settlement both recorded the id
    led.close()


def test_close_settles_a_reservation_asked_ahead_that_is_granted_during_close(tmp_path):
    """The ledger is locked by another process when the job ends, so a reservation asked ahead is
    still undecided: close() waits for it, and settles it at 0 (nobody claimed it: never sent)."""
    path = tmp_path / "b.sqlite"
    led = BudgetLedger(path)
    holder = hold_write_lock(path, 0.5)
    try:
        async def run() -> None:
            s = LedgerSession(led, "d", 10.0, None)
            s.reserve_ahead(1.0)
            await asyncio.sleep(0.05)  # its batch waits for the lock on the session's thread
            await s.close()

        asyncio.run(run())
    finally:
        holder.wait(10)
    rows = led.db.execute("SELECT state, cost, note FROM reservations").fetchall()
    assert rows == [("settled", 0.0, "not sent: job ended")]
    assert led.totals()["d"] == {"spent": 0.0, "held": 0.0}
    led.close()


class BilledFailureServer:
    """An OpenRouter-shaped endpoint on loopback whose first answer to each prompt is an HTTP error
    that reports a billed ``usage.cost``; later attempts succeed. ``billed``: what it charged."""

    def __init__(self, status: int, cost: float = 0.05):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.billed, seen = 0.0, {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = seen[body["messages"][-1]["content"]] = seen.get(body["messages"][-1]["content"], 0) + 1
                if n == 1:
                    code, doc = status, {"error": {"code": status, "message": "provider failed after generating"},
                                         "usage": {"prompt_tokens": 10, "completion_tokens": 200, "cost": cost}}
                    outer.billed += cost
                else:
                    code, doc = 200, {"id": f"gen-{n}", "provider": "P", "model": "m", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "cost": 0.001}}
                    outer.billed += 0.001
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/api/v1"


def test_a_retried_http_error_that_reports_a_cost_is_counted_at_that_cost(tmp_path, k25, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    server = BilledFailureServer(502)
    try:
        cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 5, tools_every=0), k25[0].source,
                          api_base=server.base_url)
        cfg["budget_usd"] = 10.0
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    finally:
        server.server.shutdown()
    totals = BudgetLedger(ledger_path(tmp_path / "cache")).totals()["d"]
    assert totals["held"] == pytest.approx(0, abs=1e-12)
    assert totals["spent"] == pytest.approx(server.billed) == pytest.approx(5 * 0.051)


def test_key_usage_is_never_charged_to_a_stand_in_orphan(tmp_path):
    ledger = BudgetLedger(tmp_path / "b.sqlite")
    base = "https://openrouter.ai/api/v1"
    ledger.add_key_snapshot(base, 5.0)
    ledger.apply([Reserve("real", "paid", 0.5, 10, 1.0, {"backend": "openrouter", "api_base": base}),
                  Reserve("sim", "rehearse", 0.5, 10, None, {"backend": "simulator", "api_base": None})], [])
    ledger.apply([], [("orphan", "real", {"note": "timeout"}), ("orphan", "sim", {"note": "timeout"})])
    out = ledger.reconcile_by_key_usage(base, 5.3)  # the key paid $0.30 for the lost paid answer
    assert out["orphans"] == 1 and ledger.totals()["paid"]["spent"] == pytest.approx(0.3)
    assert [o["ref"] for o in ledger.orphans()] == ["sim"]  # the stand-in's stays held until released


# a job on another machine sharing the cache dir (the SLURM profile) reserves, then its node dies
OTHER_HOST_JOB = ("import os, sys; from eagledata.generate import budget as B; B.HOST = 'node-17/0000abcd/4026531836'; "
                  "l = B.BudgetLedger(sys.argv[1]); "
                  "[l.apply([B.Reserve(r, 'd', 0.3, 1.0, None, {'backend': 'openrouter'})], []) for r in ('x1', 'x2')]; "
                  "os._exit(0)")


def test_a_job_gone_with_another_machine_stops_a_waiting_request_then_can_be_orphaned_by_host(tmp_path, k25, capsys):
    path = tmp_path / "cache" / "budget.sqlite"
    path.parent.mkdir()
    subprocess.run([sys.executable, "-c", OTHER_HOST_JOB, str(path)], check=True)
    led = BudgetLedger(path)
    assert led.recover("d", {}) == {"dead": 0, "recovered": 0}  # another host's pids cannot be checked here

    message = reserve_outcome(led, 0.5, 20, others_wait_s=0.6)  # before: polled every 0.25 s, for ever
    assert "some older than that" in message and "node-17/0000abcd/4026531836 pid" in message
    assert "eagledata budget --orphan-host" in message
    generate_cmd(make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 1), k25[0].source), tmp_path, name="c")
    assert cli_main(["budget", "--config", str(tmp_path / "c.yaml"), "--orphan-host", "node-17"]) == 0
    assert "orphaned 2 reservation(s) in flight on host node-17" in capsys.readouterr().out
    assert sorted(r["ref"] for r in led.orphans()) == ["x1", "x2"]  # held until reconciled or released
    assert led.release_orphans() == 2 and reserve(led, "r", 0.5).granted
    led.close()


def test_an_answer_arriving_after_its_reservation_was_reconciled_is_counted_at_its_cost(tmp_path):
    led = BudgetLedger(tmp_path / "b.sqlite")
    base = "https://openrouter.ai/api/v1"
    led.add_key_snapshot(base, 10.0)
    led.apply([Reserve("slow", "d", 0.3, 1.0, None, {"backend": "openrouter", "api_base": base})], [])
    led.apply([], [("orphan", "slow", {"note": "looked lost"})])
    led.reconcile_by_key_usage(base, 10.0)  # the key has not been billed yet: settled at $0
    assert led.totals()["d"]["spent"] == 0
    led.apply([], [("settle", "slow", {"cost": 0.25})])  # its answer, billed $0.25
    assert led.totals()["d"] == {"spent": pytest.approx(0.25), "held": pytest.approx(0.0)}
    cost, note = led.db.execute("SELECT cost, note FROM reservations WHERE ref='slow'").fetchone()
    assert cost == pytest.approx(0.25) and "before its answer arrived" in note
    led.apply([], [("settle", "slow", {"cost": 0.25})])  # said again: nothing changes
    assert led.totals()["d"]["spent"] == pytest.approx(0.25)
    led.close()


LIVE_IN_OTHER_PID_NAMESPACE = r"""
import os, sys, time
from eagledata.generate import budget as B
host_pids = set(map(int, os.environ["HOST_PIDS"].split(",")))
while os.getpid() in host_pids:  # a pid the host namespace does not have
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        os._exit(0)
l = B.BudgetLedger(sys.argv[1])
l.apply([B.Reserve("live", "d", 0.3, 1.0, None, {"backend": "openrouter"})], [])
open(sys.argv[2], "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[3]):  # its request is in flight
    time.sleep(0.05)
l.apply([], [("settle", "live", {"cost": 0.25})])
"""


def test_a_live_job_in_another_pid_namespace_with_the_same_host_name_is_not_taken_for_dead(tmp_path):
    """Containers sharing a host name: a pid of another PID namespace is not checked here."""
    import os
    import shutil
    import time

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode:
        pytest.skip("cannot create a PID namespace here")
    path = tmp_path / "b.sqlite"
    led = BudgetLedger(path)
    started, go = tmp_path / "started", tmp_path / "go"
    pids = ",".join(p for p in os.listdir("/proc") if p.isdigit())
    proc = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", LIVE_IN_OTHER_PID_NAMESPACE, str(path),
                             str(started), str(go)], env={**os.environ, "HOST_PIDS": pids})
    try:
        t0 = time.monotonic()
        while not started.exists():
            assert proc.poll() is None and time.monotonic() - t0 < 30
            time.sleep(0.05)
        assert led.recover("other", {})["dead"] == 0 and led.orphans() == []
    finally:
        go.write_text("x")
        proc.wait(30)
    assert led.totals()["d"] == {"spent": pytest.approx(0.25), "held": pytest.approx(0.0)}
    led.close()


def test_a_rehearsal_on_the_stand_in_and_real_spend_are_capped_apart(tmp_path, k25, monkeypatch, capsys):
    """One cache_dir, one budget_usd: the stand-in's simulated spend never uses up the real budget
    (and real spend never the rehearsal's); eagledata budget shows them on separate lines."""
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    with SimulatorServer(k25[0], k25[1], seed=1) as paid_api:  # stands for OpenRouter: backend openrouter
        cfg = make_config(tmp_path, tmp_path / "unused", k25[0].source, api_base=paid_api.base_url, max_tokens=100)
        cfg["budget_usd"] = 0.01
        cfg["datasets"] = {
            "rehearse": {"prompts": str(write_prompts(tmp_path / "r.jsonl", 100, prefix="r")), "model": "m",
                         "backend": "simulator", "budget_usd": 0.05},
            "paid": {"prompts": str(write_prompts(tmp_path / "p.jsonl", 5, prefix="p")), "model": "m",
                     "backend": "openrouter"}}
        with pytest.raises(JobStopped, match="simulator backend's own spend"):
            generate_dataset(cfg, "rehearse", tmp_path / "r.out", log=quiet)  # the rehearsal meets its cap
        summary = generate_dataset(cfg, "paid", tmp_path / "p.out", log=quiet)
        assert summary["requested"] == 5 and paid_api.requests_total == 5  # before: 0 sent, "budget" spent by the rehearsal
        led = BudgetLedger(ledger_path(tmp_path / "cache"))
        spent, held = led.billed_totals()
        assert spent == pytest.approx(paid_api.billed_usd) and held == pytest.approx(0.0)
        assert 0.005 < led.totals()["rehearse@simulator"]["spent"] <= 0.01 + 1e-12
        led.close()
        generate_cmd(cfg, tmp_path, name="c")
        assert cli_main(["budget", "--config", str(tmp_path / "c.yaml")]) == 0
        out = capsys.readouterr().out
        assert f"total: spent ${paid_api.billed_usd:.4f}" in out and "simulator (not billed; capped apart" in out
        sim_spent = BudgetLedger(ledger_path(tmp_path / "cache")).totals()["rehearse@simulator"]["spent"]
        assert f"datasets.rehearse.budget_usd 0.05: remaining ${0.05 - sim_spent:.4f} (simulator)" in out
        assert cli_main(["plan", "--config", str(tmp_path / "c.yaml"), "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)  # the rehearsal's worst case is not set against real money
        assert plan["billed_cost_worst"] == 0 and plan["cost_worst"] > 0


def test_accounts_of_a_ledger_from_before_and_of_an_earlier_version_still_writing_stay_right(tmp_path):
    """A ledger written before accounts existed gets them from its reservations; a job of the earlier
    version still running (it keeps the per-dataset totals only) keeps them right too: SQL triggers."""
    import sqlite3

    path = tmp_path / "b.sqlite"
    led = BudgetLedger(path)
    led.apply([Reserve("p", "d", 0.2, 1.0, None, {"backend": "openrouter"}),
               Reserve("s", "d", 0.3, 1.0, None, {"backend": "simulator"})], [])
    led.apply([], [("settle", "p", {"cost": 0.1})])
    led.close()
    db = sqlite3.connect(str(path), isolation_level=None)  # as the earlier version left it
    for name in ("account_totals_insert", "account_totals_update", "account_totals_delete"):
        db.execute(f"DROP TRIGGER {name}")
    db.execute("DROP TABLE account_totals")
    db.close()
    led = BudgetLedger(path)
    assert led.totals() == {"d": {"spent": pytest.approx(0.1), "held": 0.0},
                            "d@simulator": {"spent": 0.0, "held": pytest.approx(0.3)}}
    # the earlier version's job settles its rehearsal request its own way (totals per dataset, no account)
    old = sqlite3.connect(str(path), isolation_level=None)
    old.execute("BEGIN IMMEDIATE")
    old.execute("UPDATE reservations SET state='settled', cost=0.25 WHERE ref='s'")
    old.execute("UPDATE totals SET spent=spent+0.25, held=held-0.3 WHERE dataset='d'")
    old.execute("COMMIT")
    old.close()
    assert led.totals() == {"d": {"spent": pytest.approx(0.1), "held": 0.0},
                            "d@simulator": {"spent": pytest.approx(0.25), "held": pytest.approx(0.0)}}
    assert reserve(led, "next", 0.9, dataset="d").granted and not reserve(led, "more", 0.01, dataset="d").granted
    assert led.db.execute("SELECT spent, held FROM totals WHERE dataset='d'").fetchone() == pytest.approx((0.35, 0.9))
    led.close()


def test_orphan_host_matches_that_host_only(tmp_path):
    led = BudgetLedger(tmp_path / "b.sqlite")
    for ref, host in (("a", "node_1/b00t/1"), ("b", "node-1"), ("c", "node-17/b00t/1"), ("d", "nodeX1/b00t/1")):
        led.db.execute("INSERT INTO reservations(ref, dataset, host, pid, state, reserved, created, updated) "
                       "VALUES(?, 'd', ?, 1, 'reserved', 0.1, 0, 0)", (ref, host))
    assert led.orphan_host("node_1") == 1 and led.orphan_host("node-1") == 1
    assert sorted(r["ref"] for r in led.orphans()) == ["a", "b"]
    led.close()



def test_a_request_waiting_on_a_live_job_that_keeps_settling_is_not_stopped(tmp_path):
    """The other job's reservations stay young (its requests settle and new ones start): however
    long this request waits, none of them is stale, so it is not stopped."""
    import threading
    import time

    path = tmp_path / "b.sqlite"
    led = BudgetLedger(path)
    done = threading.Event()

    def busy_other_job():
        from eagledata.generate import budget as B

        other = BudgetLedger(path)
        other.pid, n = 999_999_991, 0
        B_host = "node-9/0000abcd/1/1"
        while not done.is_set():
            other.db.execute("BEGIN IMMEDIATE")
            other.db.execute("UPDATE reservations SET state='settled', cost=0 WHERE host=? AND state='reserved'", (B_host,))
            other.db.execute("INSERT INTO reservations(ref, dataset, host, pid, state, reserved, created, updated) "
                             "VALUES(?, 'd', ?, 999999991, 'reserved', 0.9, ?, ?)", (f"o{n}", B_host, time.time(), time.time()))
            other.db.execute("COMMIT")
            n += 1
            time.sleep(0.05)
        other.close()

    t = threading.Thread(target=busy_other_job)
    t.start()
    try:
        time.sleep(0.2)
        assert reserve_outcome(led, 0.5, 1.5, others_wait_s=0.3) == "still waiting"
    finally:
        done.set()
        t.join()
    led.close()


def test_reservations_of_this_machine_under_an_earlier_boot_are_dead(monkeypatch):
    from eagledata.generate import budget as B

    monkeypatch.setattr(B, "HOST", "vm/machine0001/b00t0002/4026531836")
    monkeypatch.setattr(B, "HOSTNAME", "vm")
    assert B.pid_alive(1, "vm/machine0001/b00t0001/4026531836") is False  # rebooted since: gone
    assert B.pid_alive(1, "vm/machine0001/b00t0002/4026532000") is True  # another container, this boot
    assert B.pid_alive(1, "vm/machine0002/b00t0001/4026531836") is True  # another machine
    assert B.pid_alive(999_999_999, "vm") is False  # the bare name (written before): checked here


def test_an_answer_after_a_key_usage_share_adds_its_cost(tmp_path):
    """A key-usage reconcile shares the key's unexplained spend among the orphans; a live one's
    answer arriving later is billed on top of that, not instead of its share."""
    led = BudgetLedger(tmp_path / "b.sqlite")
    base = "https://openrouter.ai/api/v1"
    led.add_key_snapshot(base, 10.0)
    for ref in ("live", "lost"):
        led.apply([Reserve(ref, "a", 0.5, 10, None, {"backend": "openrouter", "api_base": base})], [])
    led.apply([], [("orphan", "live", {}), ("orphan", "lost", {})])
    led.reconcile_by_key_usage(base, 10.2)  # the lost one's $0.20, shared by both
    led.apply([], [("settle", "live", {"cost": 0.3})])  # billed later: the key will show 10.50
    assert led.totals()["a"]["spent"] == pytest.approx(0.5)
    led.close()


def test_orphan_host_leaves_this_processs_own_reservations(tmp_path):
    from eagledata.generate import budget as B

    led = BudgetLedger(tmp_path / "b.sqlite")
    reserve(led, "mine", 0.1)
    led.db.execute("INSERT INTO reservations(ref, dataset, host, pid, state, reserved, created, updated) "
                   "VALUES('gone', 'a', ?, 1, 'reserved', 0.1, 0, 0)", (B.HOSTNAME + "/other/boot/ns",))
    assert led.orphan_host(B.HOSTNAME) == 1 and [r["ref"] for r in led.orphans()] == ["gone"]
    led.close()


def test_a_request_that_cannot_fit_does_not_wait_on_unrelated_jobs(tmp_path):
    """Settled spend alone leaves no room under the dataset's cap: no settlement can help, so it stops
    at once; and a cap is only waited on for reservations that count in it (not another dataset's
    when its own dataset cap refused, not the stand-in's when budget_usd refused real money)."""
    led = BudgetLedger(tmp_path / "b.sqlite")
    for ref in ("a", "b"):
        led.apply([Reserve(ref, "x", 0.09, None, None, {"backend": "openrouter"})], [])
        led.apply([], [("settle", ref, {"cost": 0.09})])
    for ref, ds, backend in (("other-ds", "y", "openrouter"), ("rehearsal", "x", "simulator")):
        led.db.execute("INSERT INTO reservations(ref, dataset, backend, host, pid, state, reserved, created, updated) "
                       "VALUES(?, ?, ?, 'node-9/m/b/1', 1, 'reserved', 0.5, 0, 0)", (ref, ds, backend))

    def ask(amount: float, cap: float | None, ds_cap: float | None) -> str:
        return reserve_outcome(led, amount, 3, "x", cap, ds_cap, meta={"backend": "openrouter"})

    assert ask(0.05, None, 0.20).startswith("datasets.x.budget_usd 0.2: spent $0.1800")  # hopeless
    # refused, not hopeless: an orphan of x is held (no request in flight can free it); the requests in
    # flight are another dataset's and the stand-in's, which do not count in x's cap: no wait
    led.apply([Reserve("lost", "x", 0.1, None, None, {"backend": "openrouter"})], [])
    led.apply([], [("orphan", "lost", {})])
    assert ask(0.05, None, 0.30).startswith("datasets.x.budget_usd 0.3: spent $0.1800 + held $0.1000")
    # budget_usd 0.4 refuses real money (0.18 + 0.1 held + 0.05 + y's 0.5 in flight): y's request counts, so it waits
    assert ask(0.05, 0.4, None) == "still waiting"
    led.db.execute("UPDATE reservations SET state='settled', cost=0 WHERE ref='other-ds'")
    # ... and without it only the stand-in's request is in flight, which does not count in real money
    assert ask(0.05, 0.3, None).startswith("budget_usd 0.3: spent $0.1800 + held $0.1000")
    # budget_usd 1.0: real money spent 0.18, the stand-in's 0.5 in flight does not count in it, so 0.9 never fits
    assert ask(0.9, 1.0, None).startswith("budget_usd 1: spent $0.1800 + held $0.1000")
    led.close()


def test_this_machines_reservations_written_as_name_boot_namespace_are_checked_here(tmp_path, monkeypatch):
    from eagledata.generate import budget as B

    name, machine, boot, ns = B.HOST.split("/") if B.HOST.count("/") == 3 else pytest.skip("no /proc here")
    led = BudgetLedger(tmp_path / "b.sqlite")
    led.db.execute("INSERT INTO reservations(ref, dataset, host, pid, state, reserved, created, updated) "
                   "VALUES('old', 'a', ?, 999999999, 'reserved', 0.1, 0, 0)", (f"{name}/{boot}/{ns}",))
    assert led.recover("a", {})["dead"] == 1
    led.close()


def test_one_request_too_big_for_what_is_left_lets_the_job_finish_the_others_first(tmp_path, k25, monkeypatch):
    """A worst case that no longer fits stops the job only once its own requests in flight are done:
    the other workers' smaller requests that still fit go on (found by a review)."""
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    price = {"prompt": 1.0, "completion": 10.0}
    lines = [json.dumps({"id": f"q{i:03d}", "messages": [{"role": "user", "content": f"Prompt q{i}: explain item {i}."
                                                          + (" lorem ipsum dolor" * 12000 if i == 30 else "")}]})
             for i in range(60)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    with SimulatorServer(tok, fam, seed=5, latency_ms=100, price_per_mtok=price) as sim:
        cfg = make_config(tmp_path, prompts, tok.source, api_base=sim.base_url, max_tokens=40, concurrency=4)
        cfg["models"]["m"]["price_per_mtok"] = price
        cfg["budget_usd"] = 0.05
        with pytest.raises(JobStopped, match="budget_usd"):
            generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert len(read_jsonl(tmp_path / "cache" / "d" / "responses.jsonl")) >= 50  # 30 when it stopped at once


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_usage_stays_held_until_reconciled(tmp_path, k25, monkeypatch, stream):
    """A whole answer that reports no cost nor counts (a JSON body without usage, a stream cut after
    its finish chunk) was billed an unknown amount: held at its worst case, never settled at $0 (the
    budget then ran 4x over), until the job's end reconciles it by generation id to what was billed;
    its cache line's null cost never settles an orphan at the next start."""
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    with SimulatorServer(tok, fam, seed=4, faults=lambda n, body: "no-usage") as sim:
        cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 4, tools_every=0), tok.source,
                          api_base=sim.base_url, stream=stream)
        cfg["budget_usd"] = 10.0
        summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
        assert summary["ok"] == 4 and summary["unpriced"] == 4 and summary["cost_usd"] == 0
        assert summary["ledger"]["reconciled"]["end"]["settled"] == 4
        led = BudgetLedger(ledger_path(tmp_path / "cache"))
        assert led.totals()["d"]["spent"] == pytest.approx(sim.billed_usd) and sim.billed_usd > 0
        assert led.totals()["d"]["held"] == pytest.approx(0, abs=1e-12)
        cached = [r for f in (tmp_path / "cache").rglob("*.jsonl") for r in read_jsonl(f) if "ledger_ref" in r]
        assert [r["cost"] for r in cached] == [None] * 4
    reserve(led, "lost", 0.5, dataset="d")
    led.apply([], [("orphan", "lost", {})])
    assert led.recover("d", {"lost": {"cost": None}})["recovered"] == 0  # a null cost is no price
    assert led.recover("d", {"lost": {"cost": 0.25}})["recovered"] == 1
    assert led.totals()["d"]["spent"] == pytest.approx(sim.billed_usd + 0.25)
    led.close()


def test_the_prompt_bound_covers_a_provider_that_declares_tools_as_json(k25):
    """The reservation's prompt bound for a request with tools covers what a provider rendering them
    as JSON bills (the stand-in's json-tools profile), not only the model's own TypeScript declaration
    (1.4x fewer tokens for a large schema: the budget ran 36% over)."""
    import httpx

    from eagledata.generate.plan import PromptEstimator

    tok, fam = k25
    field = {"type": "object", "description": "", "properties": {f"sub_{j}": {"type": "array", "items": {"type": "string"}}
                                                                 for j in range(6)}}
    tools = [{"type": "function", "function": {"name": "big_tool", "description": "", "parameters": {
        "type": "object", "properties": {f"field_{i}": field for i in range(12)}}}}]
    messages = [{"role": "user", "content": "use the tool"}]
    estimate, upper = PromptEstimator(tok).count(messages, tools)
    with SimulatorServer(tok, fam, seed=1, profile="json-tools") as sim:
        body = {"model": "m", "messages": messages, "tools": tools, "max_tokens": 5}
        billed = httpx.post(sim.base_url + "/chat/completions", json=body, timeout=30).json()["usage"]["prompt_tokens"]
    assert billed > estimate * 1.25 and billed <= upper, (estimate, billed, upper)


def test_plan_fails_on_a_tokenizer_that_is_there_but_does_not_load(tmp_path, k25, capsys):
    """A tokenizer directory whose vocabulary is damaged: `eagledata plan` says it cannot compute the
    requests and exits 1 (the generate job's preflight refuses it too); it exited 0 as if it were a
    tokenizer the workflow builds later."""
    broken = shutil.copytree(k25[0].source, tmp_path / "broken-tokenizer")
    (broken / "tiktoken.model").write_text("garbage\n")
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 2, tools_every=0), str(broken))
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    assert cli_main(["plan", "--config", str(cfg_path)]) == 1
    out = capsys.readouterr().out
    assert "cannot compute the requests (" in out and "tiktoken.model" in out, out
    cfg["models"]["m"]["tokenizer"] = str(k25[0].source)
    cfg_path.write_text(json.dumps(cfg))
    assert cli_main(["plan", "--config", str(cfg_path)]) == 0


def test_plan_sets_the_worst_case_against_what_is_left_of_the_dataset_cap(tmp_path, k25, capsys):
    """A dataset's own ``budget_usd`` is shown against its worst case: the plan said nothing of it, and a
    run whose cap had room for no request sent nothing and stopped (user audit r3: 10 prompts, worst
    $0.0102, $0.0009 left of a $0.003 cap)."""
    tok, _ = k25
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    cfg = make_config(tmp_path, prompts, tok.source, api_base="http://127.0.0.1:9/api/v1", max_tokens=400)
    cfg["budget_usd"] = 5.0
    cfg["datasets"]["d"]["budget_usd"] = 0.003
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    ledger = BudgetLedger(ledger_path(tmp_path / "cache"))
    try:
        assert reserve(ledger, "r1", 0.001, dataset="d", cap=None).granted
        ledger.settle("r1", 0.0021)
        assert reserve(ledger, "r2", 0.5, dataset="other", cap=None).granted  # another dataset's spend: not this cap's
        ledger.settle("r2", 0.4)
    finally:
        ledger.close()
    assert cli_main(["plan", "--config", str(cfg_path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["datasets"][0]
    assert row["dataset_remaining_usd"] == pytest.approx(0.0009)
    assert cli_main(["plan", "--config", str(cfg_path)]) == 0
    out = capsys.readouterr().out
    assert f"note: d: the worst case ${row['cost_worst']:.4f} exceeds what is left of datasets.d.budget_usd 0.003 " \
           "($0.0009)" in out
    assert "$-0.0000" not in out
    cfg["datasets"]["d"]["budget_usd"] = 1.0  # room for every worst case: no note
    cfg_path.write_text(json.dumps(cfg))
    assert cli_main(["plan", "--config", str(cfg_path)]) == 0
    assert "exceeds what is left of datasets.d.budget_usd" not in capsys.readouterr().out


def test_plan_prints_no_negative_zero_for_a_float_residue():
    from eagledata.generate.plan import format_plan

    text = format_plan({"datasets": [], "budget_usd": 5, "spent_usd": 0.0241, "held_usd": -2e-19,
                        "remaining_usd": 4.9759, "cost_low": 0.0, "cost_worst": 0.0, "billed_cost_worst": 0.0,
                        "ledger": "l"})
    assert "held $0.0000," in text and "-0.0000" not in text


def test_plan_warns_of_a_missing_api_key_where_requests_are_to_be_sent(tmp_path, k25, capsys, monkeypatch):
    """The plan showed a cost and no word of the key the generate job then stopped for (user audit r3)."""
    tok, _ = k25
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    cfg = make_config(tmp_path, prompts, tok.source, api_base="http://127.0.0.1:9/api/v1")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    assert cli_main(["plan", "--config", str(cfg_path)]) == 0  # a cost estimate needs no key
    assert "warning: dataset 'd' uses backend openrouter: set OPENROUTER_API_KEY in the environment (generation " \
           "would stop before its first request)" in capsys.readouterr().out
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    assert cli_main(["plan", "--config", str(cfg_path)]) == 0
    assert "OPENROUTER_API_KEY" not in capsys.readouterr().out
