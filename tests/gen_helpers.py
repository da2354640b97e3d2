"""Helpers shared by the generation tests: prompt files, configs, subprocess runs of the generate entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
    return [sys.executable, "-m", "eagledata.generate", "--config", str(cfg_path), "--dataset", dataset,
            "--output", str(tmp / "results" / dataset / "responses.jsonl")]


def spawn(cmd: list[str], log: Path, key: str | None = API_KEY) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OPENROUTER_API_KEY"}
    if key:
        env["OPENROUTER_API_KEY"] = key
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)
