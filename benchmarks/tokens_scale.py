"""The tokens stage at drafter-training size, as ratios measured in one run.

Builds synthetic imported datasets from the real recorded OpenRouter traffic in ../shared/recorded
(each recorded record repeated with a new id, so bodies, providers, tools and stream/JSON mix are
real), at each size in --sizes, then runs the tokens stage on each in a fresh process (one core, as a
Snakemake job runs it) and prints per size:
  wall time, tokens (prompt + completion) per second,
  the ratio to raw tiktoken encoding of the same text on one core (what the stage cannot beat),
  peak memory of the job (ru_maxrss), and how it grows with the dataset.

With --pipeline, the same datasets go through the workflow's per-shard tokens jobs (rules/tokens.smk)
in a copy of the repository, imported as datasets: `snakemake --cores 1` then, from scratch,
`--cores 2`, printing per size the wall time of each, the speed-up, tokens/s per core against raw
tiktoken (and of the token_shard jobs alone, with a fit of their seconds over their rows: a job's
start and the cost per sample), what 2 cores speed up (the stretch the token_shard jobs share the cores
in, from their logs' times, and the rest of the run), and peak memory per job of every rule (the peak
each job logs, the larger of the two runs'); then
`snakemake -n` when up to date; and over the sizes, a fit of the 1-core wall time (a run's fixed cost, then
the cost per sample: the ratio to raw tiktoken a larger dataset tends to). The recorded samples are short (about 145 tokens, prompt and
completion); --drafter runs the same on drafter-shaped samples (about 2,850 tokens: the recorded
requests made unique, answered by the stand-in with 2,500-3,500 completion tokens, half streamed),
the size public K2.5 drafters were trained on, where a job's start weighs what it does in real use. --dry-shards N
builds a dataset of N shards (shard_size 10), runs the plan, marks every other
job done (placeholder outputs in dependency order: the DAG does not depend on what a shard holds) and
times `snakemake -n` and `eagledata plan` on it; --scheduling then runs its 2,000-odd short shard jobs on 2
cores with Snakemake's default job selection and with the workflow profile's, printing both.

Usage: python benchmarks/tokens_scale.py [--sizes 10000,40000,80000] [--work DIR] [--pipeline [--shard-size 1000] [--drafter]]
       [--dry-shards 2000 [--scheduling]]
Needs ../shared (the recorded traffic and the Kimi K2 tokenizer).
"""
from __future__ import annotations

import argparse
import compileall
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
RECORDED = SHARED / "recorded" / "openrouter-kimi-k2-0905.jsonl"
TOKENIZER = SHARED / "tokenizers" / "kimi-k2-instruct"

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.tokens.shards import build_token_shards, read_shards
path, out, tok_dir = sys.argv[1:4]
fam = get_family("kimi-k2")
tok = load_tokenizer(tok_dir, fam)
t0 = time.perf_counter()
build_token_shards(path, out, tok, fam, "scale", shard_size=1000)
wall = time.perf_counter() - t0
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
df = read_shards(out).select("prompt_len", "completion_len", "verdict")
print(json.dumps({"wall": wall, "rss_mb": rss_mb, "prompt": int(df["prompt_len"].sum()),
                  "completion": int(df["completion_len"].sum()), "rows": df.height}))
"""

RAW = r"""
import json, sys, time
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.text.chat import prompt_text
from eagledata.tokens.responses import parse_response
path, tok_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = get_family("kimi-k2")
tok = load_tokenizer(tok_dir, fam)
texts = []
for i, line in enumerate(open(path, encoding="utf-8")):
    if i >= n:
        break
    rec = json.loads(line)
    req = rec["request"]
    texts.append(prompt_text(tok, req.get("messages") or [], req.get("tools")))
    p = parse_response(rec["response_raw"])
    texts += [t for t in (p.reasoning, p.content) if t]
    texts += [c.arguments for c in p.tool_calls]
enc = tok.encoding
t0 = time.perf_counter()
n_tokens = sum(len(enc.encode(t, allowed_special="all")) for t in texts)
print(json.dumps({"tokens": n_tokens, "wall": time.perf_counter() - t0, "records": min(n, i + 1)}))
"""


def build_dataset(n: int, dest: Path) -> Path:
    records = [json.loads(line) for line in RECORDED.read_text(encoding="utf-8").splitlines() if line.strip()]
    path = dest / f"responses-{n}.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            rec = dict(records[i % len(records)])
            rec["id"] = f"{rec.get('id', 'r')}-{i:07d}"
            fh.write(json.dumps(rec) + "\n")
    return path


DRAFTER = r"""
import copy, json, sys
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.standin.server import SimulatorServer
from eagledata.standin.responses import json_body, sse_stream
recorded, tok_dir, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
fam = get_family("kimi-k2")
server = SimulatorServer(load_tokenizer(tok_dir, fam), fam, seed=3, content_tokens=(2500, 3500), max_generations=1)
requests = [json.loads(l)["request"] for l in open(recorded, encoding="utf-8") if l.strip()]
with open(out, "w", encoding="utf-8") as fh:
    for i in range(n):
        body = copy.deepcopy(requests[i % len(requests)])
        body["max_tokens"] = 8000
        body["stream"] = i % 2 == 1
        user = [m for m in body["messages"] if m.get("role") == "user" and isinstance(m.get("content"), str)]
        if user:
            user[-1]["content"] += f" (request {i})"
        g = server.make_generation(body)
        raw = "".join(f"data: {p}\n\n" for p, _ in sse_stream(g)) if body["stream"] else json_body(g, "")
        fh.write(json.dumps({"id": f"d{i:07d}", "request": body, "status": 200, "response_raw": raw}) + "\n")
"""


def build_drafter_dataset(n: int, dest: Path) -> Path:
    """``n`` drafter-shaped records (2,500-3,500 completion tokens each, the size of the samples public
    K2.5 drafters were trained on: 6B tokens over 2M samples): the recorded requests, each made unique,
    answered by the OpenRouter stand-in with the real K2 tokenizer (JSON and SSE bodies, billed counts)."""
    path = dest / f"drafter-{n}.jsonl"
    if not path.exists():
        subprocess.run([sys.executable, "-c", DRAFTER, str(RECORDED), str(TOKENIZER), str(n), str(path)], check=True)
    return path


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


COPY = ["Snakefile", "rules", "scripts", "config", "src", "profiles", "envs"]


def repo_copy(dest: Path, datasets: dict, shard_size: int) -> Path:
    """A copy of the workflow whose config imports ``datasets`` (name -> responses path)."""
    import yaml
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in COPY:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, dest / name)
    config = yaml.safe_load((dest / "config/config.yaml").read_text())
    config["models"] = {"k2": {"family": "kimi-k2", "tokenizer": str(TOKENIZER)}}
    config["datasets"] = {n: {"responses": str(p), "model": "k2", "validation": {"max_bad_fraction": 1.0}}
                          for n, p in datasets.items()}
    config["tokens"] = {**(config.get("tokens") or {}), "shard_size": shard_size}
    config["extraction"] = {**config["extraction"], "enabled": False}
    (dest / "config/config.yaml").write_text(yaml.safe_dump(config))
    # the copy's modules compiled, as their first import does where PYTHONDONTWRITEBYTECODE is not set (where
    # it is, every job's process would compile the modules it imports again)
    compileall.compile_dir(dest / "src", quiet=1)
    return dest


def smk(repo: Path, *args: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1",
           "RAYON_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=repo, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"snakemake {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0


def peak_rss(repo: Path, name: str) -> dict[str, float]:
    """Per rule: the largest peak memory (MB) its jobs logged ("peak memory N MB", ru_maxrss of the job's
    process; Snakemake's benchmark: sampling misses short jobs)."""
    out: dict[str, float] = {}
    for path in (repo / "logs" / name).rglob("*.log"):
        rule = path.parent.name if path.parent.name != name else path.stem
        for m in re.finditer(r"peak memory (\d+) MB", path.read_text(errors="replace")):
            out[rule] = max(out.get(rule, 0.0), float(m.group(1)))
    return out


def shard_phases(repo: Path, name: str) -> dict[str, float]:
    """Seconds per phase inside the token_shard jobs together, as each job logs them
    ("N samples in T s: phase t, ...", eagledata.tokens.pershard.PhaseClock)."""
    out: dict[str, float] = {}
    for path in (repo / "logs" / name / "token_shard").glob("*.log"):
        for m in re.finditer(r"samples in [\d.]+ s: (.*)", path.read_text(errors="replace")):
            for part in m.group(1).split(", "):
                phase, _, secs = part.rpartition(" ")
                out[phase] = out.get(phase, 0.0) + float(secs)
    return out


def job_seconds(repo: Path, name: str, pattern: str) -> float:
    """Wall seconds of the jobs whose benchmark: files match ``pattern`` (under benchmarks/out/NAME),
    together: each job's script from its interpreter's start."""
    total = 0.0
    for path in (repo / "benchmarks/out" / name).glob(pattern):
        with open(path) as fh:
            total += sum(float(row["s"]) for row in csv.DictReader(fh, delimiter="\t"))
    return total


def shard_phase_wall(repo: Path, name: str) -> float:
    """Seconds from the first token_shard job's first log line to the last one's last (the jobs log with
    millisecond times): the part of the run the shard jobs share the cores in."""
    stamps = []
    for path in (repo / "logs" / name / "token_shard").glob("*.log"):
        times = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", path.read_text(errors="replace"), re.M)
        if times:
            stamps += [times[0], times[-1]]
    if not stamps:
        return 0.0
    first, last = (time.mktime(time.strptime(t[:19], "%Y-%m-%d %H:%M:%S")) + int(t[20:]) / 1000
                   for t in (min(stamps), max(stamps)))
    return last - first


def shard_job_seconds(repo: Path, name: str) -> float:
    """Wall seconds of every token_shard job together, process start included."""
    return job_seconds(repo, name, "token_shard/*.tsv")


def stage_parts(repo: Path, name: str, wall: float) -> dict[str, float]:
    """Seconds of the last run by step (:func:`job_seconds`), and the rest of the wall time (Snakemake's
    start, DAG, scheduling)."""
    out = {step: job_seconds(repo, name, pattern) for step, pattern in (
        ("token_plan", "token_plan.tsv"), ("token_shard jobs", "token_shard/*.tsv"), ("tokens", "tokens.tsv"))}
    out["Snakemake and the rest"] = wall - sum(out.values())
    return out


def raw_tiktoken_rate(path: Path, n: int) -> float:
    """Tokens per second raw tiktoken encodes the text of the first 5,000 records on one core."""
    raw = run(RAW, str(path), str(TOKENIZER), str(min(n, 5000)))
    return raw["tokens"] / raw["wall"]


def job_cost_fit(repo: Path, name: str) -> tuple[float, float]:
    """Least squares over the token_shard jobs of the last run: seconds = start + per_row * rows (the
    rows of each shard from plan.json). Returns (start seconds, seconds per row)."""
    plan = json.loads((repo / f"results/{name}/tokens.work/plan.json").read_text())
    pts = []
    for shard in plan["shards"]:
        with open(repo / "benchmarks/out" / name / "token_shard" / f"{shard['key']}.tsv") as fh:
            pts.append((shard["rows"], float(next(csv.DictReader(fh, delimiter="\t"))["s"])))
    return _fit(pts)


def pipeline(sizes: list[int], work: Path, shard_size: int = 1000, two_cores: bool = True, drafter: bool = False) -> int:
    rows, ratios, speedups, runs = [], [], [], []
    for n in sizes:
        path = build_drafter_dataset(n, work) if drafter else build_dataset(n, work)
        name = f"{'drafter' if drafter else 'scale'}{n}"
        raw_rate = raw_tiktoken_rate(path, n)
        walls, rss, shard_walls = {}, {}, {}
        for cores in (1, 2) if two_cores else (1,):
            repo = repo_copy(work / f"repo-{n}", {name: path}, shard_size)
            smk(repo, "--cores", "1", f"results/{name}/responses.jsonl")  # the import is not the tokens stage
            walls[cores] = smk(repo, "--cores", str(cores), f"results/{name}/tokens")
            shard_walls[cores] = shard_phase_wall(repo, name)
            if cores == 1:
                parts, phases = stage_parts(repo, name, walls[1]), shard_phases(repo, name)
            # each job's peak over both runs: on 1 core the tokens job judges every shard itself, on 2 its
            # helpers judge some (so its peak there depends on which shards it came to)
            for rule, mb in peak_rss(repo, name).items():
                rss[rule] = max(rss.get(rule, 0.0), mb)
        manifest = json.loads((repo / f"results/{name}/tokens/manifest.json").read_text())
        tokens = run(CHILD_COUNT, str(repo / f"results/{name}/tokens"))
        # raw tiktoken again after the stage: the faster of the two (a conservative ratio on a shared machine)
        raw_rate = max(raw_rate, raw_tiktoken_rate(path, n))
        dry = smk(repo, "-n", name)
        rate = tokens["tokens"] / walls[1]
        shard_rate = tokens["tokens"] / shard_job_seconds(repo, name)  # the last run's jobs
        start, per_row = job_cost_fit(repo, name)
        in_process = raw_rate * per_row / (tokens["tokens"] / manifest["rows"])  # raw time per row / ours
        rows.append((n, rss))
        ratios.append(rate / raw_rate)
        runs.append((n, walls[1], tokens["tokens"] / raw_rate))  # (samples, wall on 1 core, raw tiktoken's seconds)
        two = f"{walls[2]:.1f}s on 2 cores (speed-up {walls[1] / walls[2]:.2f}x)" if two_cores else "2 cores not run"
        if two_cores:
            speedups.append((n, walls[1] / walls[2]))
        largest = max((s["rows"] for s in manifest["shards"]), default=0)
        print(f"{n:>7} records, {len(manifest['shards'])} shards (the largest {largest} rows: the tokens job's peak "
              f"follows it, up to the cap of {manifest['sharding']['max_rows']}): tokens stage {walls[1]:.1f}s on 1 core, "
              f"{two}; {rate / 1e6:.2f}M tokens/s per core "
              f"= {rate / raw_rate:.2f}x raw tiktoken ({raw_rate / 1e6:.2f}M/s; token_shard jobs alone "
              f"{shard_rate / raw_rate:.2f}x; fitted over them: {start:.2f}s to start a job, then "
              f"{per_row * 1e3:.2f} ms per sample = {1 / in_process:.2f}x raw tiktoken); peak memory per job (MB): "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss.items())) + f"; dry run {dry:.1f}s", flush=True)
        print(f"  where the 1-core time goes, in ms per sample: "
              + ", ".join(f"{k} {v * 1e3 / manifest['rows']:.2f}" for k, v in parts.items())
              + f"; raw tiktoken's encode of the same text {tokens['tokens'] / raw_rate * 1e3 / manifest['rows']:.2f}", flush=True)
        if two_cores and all(shard_walls.values()):
            rest = {c: walls[c] - shard_walls[c] for c in (1, 2)}
            print(f"  what 2 cores speed up: the token_shard jobs {shard_walls[1]:.1f}s -> {shard_walls[2]:.1f}s "
                  f"({shard_walls[1] / shard_walls[2]:.2f}x, from the first job's start to the last one's end); the rest "
                  f"(Snakemake's start, token_plan, tokens) {rest[1]:.1f}s -> {rest[2]:.1f}s "
                  f"({rest[1] / rest[2]:.2f}x)", flush=True)
        print(f"  inside the token_shard jobs (as they log it), in ms per sample: "
              + ", ".join(f"{k} {v * 1e3 / manifest['rows']:.2f}" for k, v in phases.items())
              + "; the rest of their time is their starts", flush=True)
    for rule in sorted(rows[0][1]):
        base = rows[0][1][rule] or 1
        growth = [r.get(rule, 0) / base for _, r in rows]
        flat = all(abs(g - 1) <= 0.10 for g in growth)
        print(f"RESULT {rule} peak memory relative to {sizes[0]} records: "
              + ", ".join(f"{n}: {g:.2f}x" for (n, _), g in zip(rows, growth))
              + f" ({'flat within 10%' if flat else 'NOT flat within 10%'})")
    worst = min(r for r in ratios)
    print(f"RESULT tokens stage per core / raw tiktoken: "
          + ", ".join(f"{n}: {r:.2f}x" for n, r in zip(sizes, ratios))
          + f"; worst {worst:.2f}x (target >= 0.3x): {'OK' if worst >= 0.3 else 'BELOW TARGET'}"
          + (", met at " + ", ".join(str(n) for n, r in zip(sizes, ratios) if r >= 0.3) if worst < 0.3 <= max(ratios) else "")
          + "; 1->2 core speed-ups: " + ", ".join(f"{n}: {x:.2f}x" for n, x in speedups) + " (noisy on a shared machine)")
    fixed, per_sample = _fit([(n, wall) for n, wall, _ in runs]) if len({n for n, _, _ in runs}) >= 2 else (0.0, 0.0)
    if per_sample > 0:
        raw_per_sample = sum(raw for _, _, raw in runs) / sum(n for n, _, _ in runs)
        print(f"RESULT fitted over the sizes on 1 core: a run's fixed {fixed:.1f}s (Snakemake's start and DAG, the jobs' "
              f"starts), then {per_sample * 1e3:.3f} ms per sample = {raw_per_sample / per_sample:.2f}x raw tiktoken per core "
              f"(what the ratio tends to as the dataset grows)")
    return 0


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` over ``points``: (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - slope * mx, slope


CHILD_COUNT = r"""
import json, sys
from eagledata.tokens.shards import read_shards
df = read_shards(sys.argv[1]).select("prompt_len", "completion_len")
print(json.dumps({"tokens": int(df["prompt_len"].sum() + df["completion_len"].sum())}))
"""


def dry_run_at(n_shards: int, work: Path, scheduling: bool = False) -> int:
    """`snakemake -n` and `eagledata plan` on a dataset of about ``n_shards`` shards, every job done; with
    ``scheduling``, then :func:`scheduling_at`."""
    n = n_shards * 10
    path = build_dataset(n, work)
    name = "dry"
    repo = repo_copy(work / "repo-dry", {name: path}, 10)
    smk(repo, "--cores", "2", f"results/{name}/tokens.work/plan.json")
    plan = json.loads((repo / f"results/{name}/tokens.work/plan.json").read_text())
    w = repo / f"results/{name}/tokens.work"
    keys = [s["key"] for s in plan["shards"]]
    # placeholder outputs, each step's files newer than its inputs (the DAG does not depend on what a
    # shard holds; Snakemake's --touch over 4,000 jobs takes minutes); the code stamps are real (written
    # while the workflow is parsed)
    steps = [[w / "parts" / f"{k}.parquet" for k in keys] + [w / "parts" / f"{k}.summary.json" for k in keys],
             [repo / f"results/{name}/tokens"],
             [repo / f"results/{name}" / f for f in ("validation.json", "validation.txt")]]
    stamp = time.time()
    for i, files in enumerate(steps):
        for f in files:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.mkdir(exist_ok=True) if f.name == "tokens" else f.touch()
            os.utime(f, (stamp + i + 1, stamp + i + 1))
    left = _planned_outputs(repo, name)
    if left:
        raise SystemExit(f"not up to date after marking every job done: {sorted(map(str, left))[:5]}")
    t_dry = min(smk(repo, "-n", name) for _ in range(3))
    t_dry_q = min(smk(repo, "-n", name, "--quiet", "all") for _ in range(2))
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eagledata.cli", "plan", "--config", "config/config.yaml"], cwd=repo,
                   capture_output=True, text=True, env=env)
    t_plan = time.perf_counter() - t0
    print(f"RESULT dry run at {len(plan['shards'])} shards ({n} records): snakemake -n {t_dry:.2f}s "
          f"(-q all: {t_dry_q:.2f}s), eagledata plan {t_plan:.2f}s (target < 5 s)")
    if scheduling:
        scheduling_at(repo, name, len(plan["shards"]))
    return 0


def scheduling_at(repo: Path, name: str, n_shards: int) -> None:
    """Every token_shard job of the dataset (and the tokens job) run for real on 2 cores, with Snakemake's
    default job selection (an ILP over every ready job each round) and then with the workflow profile's
    (greedy over a random sample): the jobs are short (10 samples each), so the time is Snakemake's."""
    walls = {}
    for label, args in (("Snakemake's default selection (ILP over every ready job)",
                         ["--scheduler", "ilp", "--scheduler-subsample", "0"]),
                        ("the workflow profile's (profiles/default)", [])):
        walls[label] = smk(repo, "--cores", "2", *args, "--forcerun", "token_shard", f"results/{name}/tokens")
        print(f"  {n_shards} token_shard jobs + tokens on 2 cores, {label}: {walls[label]:.1f}s", flush=True)
    default, profile = walls.values()
    print(f"RESULT scheduling {n_shards} shard jobs on 2 cores: the profile's job selection {profile:.1f}s vs "
          f"Snakemake's default {default:.1f}s ({default / profile:.2f}x faster)")


def _planned_outputs(repo: Path, target: str) -> list[Path]:
    """Output files a dry run of ``target`` would (re)build (`snakemake -n --summary`-free: parsed from
    the dry run's `output:` lines)."""
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", target], cwd=repo, capture_output=True, text=True,
                         env=env)
    files = []
    for line in out.stdout.splitlines():
        if line.strip().startswith("output:"):
            files += [repo / f.strip() for f in line.split(":", 1)[1].split(",")]
    return files


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,40000,80000")
    ap.add_argument("--work", help="directory for the synthetic datasets (default: a temp dir)")
    ap.add_argument("--pipeline", action="store_true", help="the workflow's per-shard jobs, 1 vs 2 cores")
    ap.add_argument("--shard-size", type=int, default=1000, help="tokens.shard_size of --pipeline (config default 1000)")
    ap.add_argument("--one-core", action="store_true", help="--pipeline at 1 core only (no speed-up)")
    ap.add_argument("--dry-shards", type=int, help="time the dry run of a dataset of this many shards")
    ap.add_argument("--scheduling", action="store_true", help="--dry-shards, then run its jobs with Snakemake's "
                    "default job selection and with the workflow profile's (minutes)")
    ap.add_argument("--drafter", action="store_true", help="--pipeline on drafter-shaped samples (~3,000 completion "
                    "tokens each, answered by the stand-in) instead of the recorded ones (~145 tokens each)")
    args = ap.parse_args()
    if not RECORDED.exists() or not TOKENIZER.exists():
        print(f"needs {RECORDED} and {TOKENIZER}")
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="tokens-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.dry_shards:
        return dry_run_at(args.dry_shards, work, args.scheduling)
    if args.pipeline:
        return pipeline(sizes, work, args.shard_size, not args.one_core, args.drafter)
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        path = build_dataset(n, work)
        built = time.perf_counter() - t0
        stage = run(CHILD, str(path), str(work / f"tokens-{n}"), str(TOKENIZER))
        raw = run(RAW, str(path), str(TOKENIZER), str(min(n, 5000)))
        raw_rate = raw["tokens"] / raw["wall"]
        rate = (stage["prompt"] + stage["completion"]) / stage["wall"]
        rows.append((n, stage, rate, raw_rate))
        print(f"{n:>7} records ({path.stat().st_size / 1e6:,.0f} MB, built in {built:.1f}s): tokens stage "
              f"{stage['wall']:.1f}s, {rate / 1e6:.2f}M tokens/s on one core = {rate / raw_rate:.2f}x raw tiktoken "
              f"({raw_rate / 1e6:.2f}M/s); peak memory {stage['rss_mb']:.0f} MB", flush=True)
    base = rows[0][1]["rss_mb"]
    growth = ", ".join(f"{n}: {s['rss_mb'] / base:.2f}x" for n, s, _, _ in rows)
    flat = all(abs(s["rss_mb"] / base - 1) <= 0.10 for _, s, _, _ in rows)
    print(f"RESULT peak memory relative to {sizes[0]} records: {growth} ({'flat within 10%' if flat else 'NOT flat'})")
    worst = min(r / w for _, _, r, w in rows)
    print(f"RESULT tokens stage / raw tiktoken per core: worst {worst:.2f}x (target >= 0.3x): "
          f"{'OK' if worst >= 0.3 else 'BELOW TARGET'}")
    print("RESULT 1-core vs 2-core speed-up: see --pipeline (one job per shard)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
