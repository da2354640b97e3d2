"""Helpers shared by the generation tests: prompt files, configs, subprocess runs of the generate entry,
the stand-in in its own process (counters over HTTP), the cache's lines and the ledger's rows."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

API_KEY = "sk-or-v1-test-0123456789abcdef-never-write-me"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def write_prompts(path: Path, n: int, tools_every: int = 3, prefix: str = "q") -> Path:
    lines = []
    for i in range(n):
        p = {"id": f"{prefix}{i:03d}", "messages": [{"role": "user", "content": f"Prompt {prefix}{i}: explain item {i}."}]}
        if tools_every and i % tools_every == 0:
            p["tools"] = TOOLS
        lines.append(json.dumps(p))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_config(tmp: Path, prompts: Path, tokenizer: str, backend: str = "openrouter", api_base: str | None = None,
                **generation) -> dict:
    gen = {"max_tokens": 300, "concurrency": 4, "backoff_base_s": 0.001, "backoff_max_s": 0.01, "max_attempts": 4,
           "timeout_s": 20, **generation}
    if api_base:
        gen["api_base"] = api_base
    return {"cache_dir": str(tmp / "cache"), "results_dir": str(tmp / "results"), "simulator": {"seed": 3},
            "models": {"m": {"family": "kimi-k2.5", "tokenizer": str(tokenizer), "api_model": "moonshotai/kimi-k2.5",
                             "price_per_mtok": {"prompt": 0.6, "completion": 2.5}}},
            "generation": gen,
            "datasets": {"d": {"prompts": str(prompts), "model": "m", "backend": backend}}}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def quiet(_msg: str) -> None:
    pass


def generate_cmd(config: dict, tmp: Path, dataset: str = "d", name: str = "cfg") -> list[str]:
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "eagledata.generate.job", "--config", str(cfg_path), "--dataset", dataset,
            "--output", str(tmp / "results" / dataset / "responses.jsonl")]


def spawn(cmd: list[str], log: Path, key: str | None = API_KEY, cwd: Path | None = None,
          **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OPENROUTER_API_KEY"}
    if key:
        env["OPENROUTER_API_KEY"] = key
    env.update(env_extra)
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=cwd)


def cache_lines(tmp: Path, dataset: str = "d") -> list[dict]:
    """The records of ``tmp/cache/{dataset}/responses.jsonl`` (a torn last line left out)."""
    path = tmp / "cache" / dataset / "responses.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]


def wait_cache_lines(tmp: Path, n: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until the cache holds ``n`` records, ``proc`` (a generate job) still running."""
    t0 = time.monotonic()
    while len(cache_lines(tmp)) < n:
        assert proc.poll() is None, "generate ended early"
        assert time.monotonic() - t0 < timeout, "no progress"
        time.sleep(0.01)


def ledger_rows(tmp: Path) -> list[tuple]:
    """(state, reserved, cost, generation_id, note) of every reservation in ``tmp/cache/budget.sqlite``
    (none before a job created it)."""
    path = tmp / "cache" / "budget.sqlite"
    if not path.exists():
        return []
    db = sqlite3.connect(str(path))
    try:
        return db.execute("SELECT state, reserved, cost, generation_id, note FROM reservations").fetchall()
    finally:
        db.close()


def ledger_counted(tmp: Path) -> float:
    """What the ledger counts as spent: settled costs plus what it still holds (reserved, orphaned)."""
    return sum(r[2] if r[0] == "settled" else r[1] for r in ledger_rows(tmp))


class StandInProcess:
    """The stand-in run as a user runs it (``python -m eagledata.standin.server``), in its own process;
    :meth:`counters` reads ``GET /_sim/counters``."""

    def __init__(self, tokenizer: str | Path, tmp: Path, latency_ms: float = 0, jitter_ms: float = 0, seed: int = 2):
        port_file = tmp / f"stand-in-{time.monotonic_ns()}.port"
        self.log = port_file.with_suffix(".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eagledata.standin.server", "--tokenizer", str(tokenizer), "--family", "kimi-k2.5",
             "--seed", str(seed), "--latency-ms", str(latency_ms), "--latency-jitter-ms", str(jitter_ms),
             "--port-file", str(port_file)], stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() - t0 < 60, "stand-in did not start"
            time.sleep(0.02)
        self.root_url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.base_url = self.root_url + "/api/v1"

    def counters(self) -> dict:
        with urllib.request.urlopen(self.root_url + "/_sim/counters", timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
