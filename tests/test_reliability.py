"""Reliability holes of issue 11, tried from outside: a misspelled config key at any level (real
``snakemake -n`` and ``eagledata plan`` runs), an unsafe dataset name, checks that used to come only
after paying (the preflight: tokenizer missing or broken, an unrenderable prompt, missing extraction
weights, a full cache disk; the stand-in's counters prove nothing was sent), and the column of a JSON
error in a prompt file."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

from conftest import need_shared
from workflow_runs import copy_repo
from gen_helpers import API_KEY, StandInProcess, generate_cmd, make_config, quiet, spawn, write_prompts

ROOT = Path(__file__).resolve().parents[1]


def demo_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def snakemake_dry_run(work: Path, configfile: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(configfile)], work)


def eagledata_plan(work: Path, configfile: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "eagledata.cli", "plan", "--config", str(configfile)], work)


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")} if path.exists() else set()


@pytest.fixture
def stand_in(k25, tmp_path):
    """The stand-in in its own process (``python -m eagledata.standin.server``), counters over HTTP."""
    s = StandInProcess(k25[0].source, tmp_path)
    yield s
    s.stop()


def assert_nothing_sent(stand_in: StandInProcess, tmp: Path) -> None:
    c = stand_in.counters()
    assert (c["requests_total"], c["generations"], c["billed_usd"]) == (0, 0, 0), c
    assert not (tmp / "cache" / "budget.sqlite").exists()  # the ledger was never opened
    assert not (tmp / "cache" / "d" / "responses.jsonl").exists()


def run_generate(cfg: dict, tmp: Path) -> tuple[int, str]:
    log = tmp / "generate.log"
    proc = spawn(generate_cmd(cfg, tmp), log)
    code = proc.wait(120)
    return code, log.read_text()


def copy_k25_tokenizer(dest: Path) -> Path:
    shutil.copytree(need_shared("tokenizers", "kimi-k2.5"), dest)
    return dest


# --------------------------------------------------------------------------------------------
# 1. unknown keys refused at every level, with the file, the key path and a "did you mean"


def _walk(node, path, out):
    if isinstance(node, dict):
        if node.get("type") == "object" or "object" in (node.get("type") or []) or "properties" in node:
            out.append((path, node))
        for key, value in node.items():
            _walk(value, path + [key], out)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, path + [i], out)
    return out


def test_every_object_of_the_schema_is_closed():
    """Proves: each object schema is closed (additionalProperties false), except the generation
    block, which is closed through its $ref, and the user-keyed maps whose entries are closed
    schemas; families take exactly ModelFamily's fields; both generation blocks know the same keys."""
    from eagledata.config import schema
    from eagledata.text.families import ModelFamily

    sch = schema()
    open_maps = {("$defs", "generation", "properties", "extra_body"),
                 ("properties", "extraction", "properties", "sglang_server_args")}
    for path, node in _walk(sch, [], []):
        key = tuple(path)
        if key == ("properties", "generation"):
            assert node["allOf"] == [{"$ref": "#/$defs/generation"}]
            continue
        if key in open_maps:
            assert "properties" not in node
            continue
        addl = node.get("additionalProperties")
        assert addl is False or (isinstance(addl, dict) and ("$ref" in addl or addl.get("additionalProperties") is False)), path
    fields = {f.name for f in dataclasses.fields(ModelFamily)} - {"name"}
    assert set(sch["$defs"]["family"]["properties"]) == fields | {"base"}
    assert set(sch["properties"]["generation"]["properties"]) == set(sch["$defs"]["generation"]["properties"])
    assert sch["properties"]["datasets"]["additionalProperties"]["properties"]["generation"]["$ref"] == "#/$defs/generation"


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c.update(budgett_usd=c.pop("budget_usd")), "budgett_usd: unknown key; did you mean `budget_usd`?"),
    (lambda c: c["datasets"]["chat"].update(max_tokenz=300),
     "datasets.chat.max_tokenz: unknown key; did you mean `max_tokens`? It belongs under `datasets.chat.generation`"),
    (lambda c: c["generation"].update(max_tokenz=300), "generation.max_tokenz: unknown key; did you mean `max_tokens`?"),
    (lambda c: c["datasets"]["chat"].update(generation={"temprature": 0.5}),
     "datasets.chat.generation.temprature: unknown key; did you mean `temperature`?"),
    (lambda c: c["extraction"].update(dtpye="float32"), "extraction.dtpye: unknown key; did you mean `dtype`?"),
    (lambda c: c["models"]["demo"]["price_per_mtok"].update(completoin=2.5),
     "models.demo.price_per_mtok.completoin: unknown key; did you mean `completion`?"),
], ids=["budgett_usd", "datasets.max_tokenz", "generation.max_tokenz", "datasets.generation", "extraction", "price"])
def test_unknown_key_message_names_file_path_and_nearest_key(tmp_path, mutate, expected):
    """Proves (in process, every level): the message is 'FILE: KEY.PATH: unknown key; did you mean
    `KEY`?', also for a key written one block too high."""
    path, message = _config_error(tmp_path, mutate)
    assert message.startswith(f"{path}: {expected}"), message


def _config_error(tmp_path, mutate) -> tuple[Path, str]:
    """(the config file, the ConfigError's message) for the demo config changed by ``mutate``."""
    from eagledata.config import ConfigError, load_config

    cfg = demo_config()
    cfg.setdefault("generation", {})
    mutate(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return path, str(err.value)


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c["generation"].update(temperature=float("nan")), "generation.temperature: nan is not a number JSON can carry"),
    (lambda c: c["datasets"]["chat"].update(generation={"top_p": float("inf")}),
     "datasets.chat.generation.top_p: inf is not a number JSON can carry"),
    (lambda c: c["generation"].update(max_tokens=200.0), "generation.max_tokens: 200.0 is not of type 'integer'"),
    (lambda c: c["generation"].update(api_base="ftp://example.org/v1"), "generation.api_base: 'ftp://example.org/v1' does not match"),
    (lambda c: c["models"]["demo"].update(price_per_mtok={"prompt": 0.6}),
     "models.demo.price_per_mtok: 'completion' is a required property"),
    (lambda c: c["extraction"].update(final_norm="after"), "extraction.final_norm: removed ('after')"),
    (lambda c: c["datasets"]["chat"].update(responses="r.jsonl"), "datasets.chat: give exactly one of `prompts`"),
    (lambda c: c["datasets"]["chat"].pop("prompts"), "datasets.chat: give exactly one of `prompts`"),
    (lambda c: c.setdefault("validation", {}).update(policy="lenient"),
     "validation.policy: 'lenient' is not one of ['default', 'strict'"),
    (lambda c: c.setdefault("validation", {}).update(policy={"completion": ["exactt"]}),
     "validation.policy.completion.0: 'exactt' is not one of"),
    (lambda c: c.setdefault("simulator", {}).update(provider="exactt"), "simulator.provider: unknown stand-in profile 'exactt'"),
], ids=["nan", "inf", "float max_tokens", "api_base scheme", "half a price", "final_norm", "prompts and responses",
        "neither", "policy preset", "policy mapping", "stand-in profile"])
def test_values_a_request_cannot_carry_are_refused_before_anything_is_sent(tmp_path, mutate, expected):
    """NaN/Infinity (YAML .nan/.inf: not JSON), an integer written as 200.0 (JSON Schema counts it an
    integer; the API refuses "max_tokens": 200.0), a URL no HTTP client sends to, and a price with its
    completion half left out (priced $0: the budget stopped nothing) are config errors naming the key;
    so are the removed final_norm, a dataset with both or neither of prompts/responses, and values
    outside a choice (named, with the choices: not "is not valid under any of the given schemas")."""
    path, message = _config_error(tmp_path, mutate)
    assert message.startswith(f"{path}: {expected}"), message


@pytest.mark.workflow
@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c.update(budgett_usd=c.pop("budget_usd")), "budgett_usd: unknown key; did you mean `budget_usd`?"),
    (lambda c: c["datasets"]["chat"].update(max_tokenz=300), "datasets.chat.max_tokenz: unknown key; did you mean `max_tokens`?"),
], ids=["budgett_usd", "datasets.chat.max_tokenz"])
def test_snakemake_dry_run_and_plan_stop_on_a_typo(tmp_path, mutate, expected):
    """Proves (real `snakemake -n` and `eagledata plan` processes): both stop, non-zero, with our
    message naming the config file, the key path and the did-you-mean (not Snakemake's schema dump),
    and nothing is planned or written."""
    work = copy_repo(tmp_path / "w")
    cfg = demo_config()
    mutate(cfg)
    typo = work / "typo.yaml"
    typo.write_text(yaml.safe_dump(cfg))
    before = files_under(work)

    sm = snakemake_dry_run(work, typo)
    assert sm.returncode != 0
    text = sm.stdout + sm.stderr
    assert f"{typo}: {expected}" in text, text[-3000:]
    assert "Failed validating" not in text and "Job stats" not in text

    plan = eagledata_plan(work, typo)
    assert plan.returncode == 2
    assert plan.stderr.startswith(f"eagledata plan: {typo}: {expected}"), plan.stderr
    assert "Traceback" not in plan.stderr
    assert not (work / "results").exists() and not (work / "logs").exists() and not (work / ".cache").exists()
    assert {p for p in files_under(work) - before if ".snakemake" not in p.parts} == set()


@pytest.mark.workflow
def test_snakemake_dry_run_and_run_stop_on_a_missing_tokenizer_directory(tmp_path):
    """Proves (real `snakemake -n` and `snakemake all` processes): a dataset's model whose tokenizer
    directory does not exist stops both while the workflow is parsed, non-zero, naming the config file,
    `models.NAME.tokenizer`, the path and the datasets (before: the dry run planned every job, and the
    first job to load the tokenizer failed); nothing is planned or written. A model no dataset uses is
    not checked, and a hub id (no local files) and the demo's tokenizer (a rule builds it) still plan."""
    work = copy_repo(tmp_path / "w")
    missing = tmp_path / "no-such-tokenizer"
    cfg = demo_config()
    cfg["models"]["spare"] = {**cfg["models"]["demo"], "tokenizer": str(tmp_path / "spare-tokenizer")}
    cfg["models"]["demo"]["tokenizer"] = str(missing)
    bad = work / "missing.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    before = files_under(work)

    expected = (f"{bad}: models.demo.tokenizer: tokenizer directory not found: {missing} "
                "(the model of dataset(s) chat, multiturn, tools)")
    for sm in (snakemake_dry_run(work, bad),
               run([sys.executable, "-m", "snakemake", "--cores", "1", "all", "--configfile", str(bad)], work)):
        text = sm.stdout + sm.stderr
        assert sm.returncode != 0 and expected in text, text[-3000:]
        assert "Job stats" not in text and "spare" not in text
    assert {p for p in files_under(work) - before if ".snakemake" not in p.parts} == set()

    hub = {**cfg["models"]["demo"], "tokenizer": "moonshotai/Kimi-K2.5"}  # the form of a hub id, no such path
    cfg["models"] = {"demo": {**hub, "tokenizer": "results/_assets/demo-tokenizer"}, "hub": hub,
                     "spare": cfg["models"]["spare"]}
    cfg["datasets"]["multiturn"]["model"] = "hub"
    good = work / "good.yaml"
    good.write_text(yaml.safe_dump(cfg))
    sm = snakemake_dry_run(work, good)
    assert sm.returncode == 0 and "Job stats" in sm.stdout + sm.stderr, (sm.stdout + sm.stderr)[-3000:]


def test_a_correct_config_still_passes_and_examples_validate():
    """Proves: closing the schema rejects nothing real: the demo, every example and a config using
    every override block load."""
    from eagledata.config import load_config, validate_config

    for path in [ROOT / "config" / "config.yaml", *sorted((ROOT / "config" / "examples").glob("*.yaml"))]:
        load_config(path)
    cfg = demo_config()
    cfg["families"] = {"mine": {"base": "kimi-k2.5", "think_in_prompt": False, "tool_declaration": "json"}}
    cfg["generation"].update(reasoning={"effort": "high"}, tool_choice={"type": "function", "function": {"name": "f"}},
                             provider={"order": ["a"], "max_price": {"prompt": 1, "completion": 2}}, extra_body={"top_k": 5})
    cfg["datasets"]["chat"].update(generation={"max_tokens": 50}, budget_usd=0.5, validation={"max_bad_fraction": 0.1})
    cfg["extraction"]["sglang_server_args"] = {"ep_size": 8}
    out = validate_config(cfg)
    assert out["datasets"]["chat"]["generation"] == {"max_tokens": 50}  # no defaults leak into overrides
    assert out["generation"]["max_tokens"] == 400 and out["generation"]["concurrency"] == 8


@pytest.mark.parametrize("where", ["generation", "dataset"])
def test_extra_body_may_not_set_what_the_budget_reserves_by(tmp_path, where):
    """Proves: generation.extra_body.max_tokens (sent as is, while the budget and `eagledata plan`
    reserve by generation.max_tokens) is refused naming the file, the key path and the setting to
    use, in the global block and in a dataset's."""
    from eagledata.config import ConfigError, load_config

    cfg = demo_config()
    block = cfg["generation"] if where == "generation" else cfg["datasets"]["chat"].setdefault("generation", {})
    block["extra_body"] = {"top_k": 5, "max_tokens": 3000}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    key = "generation" if where == "generation" else "datasets.chat.generation"
    assert str(err.value) == (f"{path}: {key}.extra_body.max_tokens: set generation.max_tokens instead: the budget "
                              "and eagledata plan reserve by it")
    block["extra_body"] = {"n": 2}  # several choices in one response would be read as one answer
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=rf"{key}\.extra_body\.n: one completion per request"):
        load_config(path)


# --------------------------------------------------------------------------------------------
# 2. dataset names


@pytest.mark.parametrize("name", ["../../evil", "a/b", ".hidden", "..", "sp ace", "x\\y"])
def test_unsafe_dataset_names_are_refused_with_the_rule(name, tmp_path):
    """Proves: each unsafe name is refused by load_config, the message states the rule."""
    from eagledata.config import ConfigError, load_config

    cfg = demo_config()
    cfg["datasets"] = {name: cfg["datasets"]["chat"]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: datasets.\"{name}\": dataset name {name!r} is not allowed")
    assert "only letters, digits, '.', '_' and '-'" in msg and "may not start with '.'" in msg


def test_safe_dataset_names_are_accepted():
    """Proves: the allowed names pass; a name YAML read as a number is refused with how to quote it."""
    from eagledata.config import ConfigError, validate_config

    cfg = demo_config()
    cfg["datasets"] = {n: dict(cfg["datasets"]["chat"]) for n in ("B3", "my.set-1_x", "_x", "-y", "2024")}
    assert list(validate_config(cfg)["datasets"]) == ["B3", "my.set-1_x", "_x", "-y", "2024"]
    cfg = demo_config()
    cfg["datasets"] = {2024: cfg["datasets"]["chat"]}
    with pytest.raises(ConfigError, match=r"datasets\.2024: a dataset name must be a string; quote it"):
        validate_config(cfg, "c.yaml")


@pytest.mark.workflow
def test_dataset_named_dot_dot_evil_writes_nothing_anywhere(tmp_path):
    """Proves (a real `snakemake` run, `eagledata plan` and the generate entry): a dataset named
    `../../evil` is refused with the rule, and no file appears in or above the work directory."""
    outer = tmp_path / "outer"
    work = copy_repo(outer / "a" / "w")
    cfg = demo_config()
    cfg["datasets"] = {"../../evil": cfg["datasets"]["chat"]}
    bad = work / "evil.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    before = files_under(outer)

    sm = run([sys.executable, "-m", "snakemake", "--cores", "1", "all", "--configfile", str(bad)], work)
    assert sm.returncode != 0
    assert "dataset name '../../evil' is not allowed" in sm.stdout + sm.stderr
    assert "may use only letters, digits" in sm.stdout + sm.stderr
    plan = eagledata_plan(work, bad)
    assert plan.returncode == 2 and "dataset name '../../evil' is not allowed" in plan.stderr
    gen = run([sys.executable, "-m", "eagledata.generate.job", "--config", str(bad), "--dataset", "../../evil",
               "--output", "results/../../evil/responses.jsonl"], work)
    assert gen.returncode == 1 and "dataset name '../../evil' is not allowed" in gen.stderr

    new = {p for p in files_under(outer) - before if ".snakemake" not in p.parts}
    assert new == set(), sorted(new)
    assert not list(outer.rglob("evil")) and not (work / "results").exists() and not (work / "logs").exists()


# --------------------------------------------------------------------------------------------
# 3. preflight before the first paid request


def test_missing_tokenizer_directory_stops_before_any_request(tmp_path, stand_in):
    """Proves (generate entry in its own process, stand-in in another): a missing tokenizer
    directory stops the job before anything is sent (counters 0, no ledger, no cache), with
    'tokenizer directory not found: PATH' and no traceback or hub/repo-id error; `eagledata plan`
    reports the same and exits 1."""
    missing = tmp_path / "no-such-tokenizer"
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 4), str(missing), api_base=stand_in.base_url)
    code, log = run_generate(cfg, tmp_path)
    assert code == 1, log
    assert f"tokenizer directory not found: {missing} (models.m.tokenizer)" in log
    assert "nothing was sent" in log
    assert "Traceback" not in log and "repo id" not in log.lower() and "huggingface" not in log.lower()
    assert_nothing_sent(stand_in, tmp_path)

    plan = eagledata_plan(tmp_path, tmp_path / "cfg.yaml")
    assert plan.returncode == 1, plan.stdout + plan.stderr
    assert f"error: d: tokenizer directory not found: {missing}" in plan.stdout


def test_tokenizer_with_a_wrong_special_id_stops_before_paying(tmp_path, stand_in):
    """Proves: a tokenizer whose config gives `<|im_end|>` a wrong id (one inside the BPE ranks)
    stops the job before any request, naming the file, the token and the id."""
    tok = copy_k25_tokenizer(tmp_path / "tok")
    cfg_file = tok / "tokenizer_config.json"
    tc = json.loads(cfg_file.read_text())
    old = next(i for i, e in tc["added_tokens_decoder"].items() if e["content"] == "<|im_end|>")
    tc["added_tokens_decoder"]["1000"] = tc["added_tokens_decoder"].pop(old)
    cfg_file.write_text(json.dumps(tc))
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 4), str(tok), api_base=stand_in.base_url)
    code, log = run_generate(cfg, tmp_path)
    assert code == 1, log
    assert f"tokenizer {tok} is unusable" in log and "'<|im_end|>': 1000" in log and str(cfg_file) in log, log
    assert "Traceback" not in log
    assert_nothing_sent(stand_in, tmp_path)


@pytest.fixture
def in_process(k25, monkeypatch, tmp_path):
    """The stand-in in process (its counters read directly) and a config pointing at it."""
    from eagledata.standin.server import SimulatorServer

    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    with SimulatorServer(*k25, seed=2) as sim:
        cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 5), k25[0].source, api_base=sim.base_url)
        yield sim, cfg


def _stopped(cfg: dict, tmp: Path) -> str:
    from eagledata.generate.job import generate_dataset
    from eagledata.generate.preflight import PreflightError

    with pytest.raises(PreflightError) as err:
        generate_dataset(cfg, "d", tmp / "results" / "d" / "responses.jsonl", log=quiet)
    return str(err.value)


def test_failing_self_check_stops_before_paying(in_process, tmp_path, monkeypatch):
    """Proves: a tokenizer failing its self-check (a special id that decodes to another token)
    stops the job in preflight, the message naming the token, the id and the directory."""
    import eagledata.generate.tokenizers as plan_mod
    import eagledata.text.tokenizer as tokenizer_mod

    sim, cfg = in_process
    monkeypatch.setattr(plan_mod, "_TOKENIZERS", {})  # no tokenizer loaded by an earlier test
    real = tokenizer_mod.load_tiktoken_dir

    def wrong(*a, **kw):
        tok = real(*a, **kw)
        return dataclasses.replace(tok, specials={**tok.specials, "<|im_end|>": tok.specials["<|im_end|>"] - 1})

    monkeypatch.setattr(tokenizer_mod, "load_tiktoken_dir", wrong)
    msg = _stopped(cfg, tmp_path)
    assert "special token '<|im_end|>'" in msg and "failed self-check" in msg and str(cfg["models"]["m"]["tokenizer"]) in msg
    assert sim.requests_total == 0


def test_unrenderable_prompt_stops_before_paying(in_process, tmp_path):
    """Proves: every prompt is rendered with the chat template first; one the template refuses
    stops the job naming file:line and the prompt id; nothing is sent."""
    sim, cfg = in_process
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                        "{% endif %}{{ m.content }}{% endfor %}")
    cfg["models"]["m"]["chat_template"] = str(template)
    prompts = Path(cfg["datasets"]["d"]["prompts"])
    with open(prompts, "a") as fh:
        fh.write(json.dumps({"id": "sys", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) + "\n")
    msg = _stopped(cfg, tmp_path)
    assert f"{prompts}:6: prompt 'sys' cannot be rendered" in msg and "no system role" in msg
    assert sim.requests_total == 0


def test_missing_extraction_weights_stop_before_paying(in_process, tmp_path):
    """Proves: with extraction enabled, missing weights stop the job before any request; with
    extraction disabled the same config generates."""
    from eagledata.generate.job import generate_dataset

    sim, cfg = in_process
    cfg["models"]["m"]["weights"] = str(tmp_path / "no-weights")
    msg = _stopped(cfg, tmp_path)
    assert f"extraction weights directory not found: {tmp_path / 'no-weights'}" in msg
    assert sim.requests_total == 0
    cfg["extraction"] = {"enabled": False}
    assert generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)["requested"] == 5


def test_full_cache_disk_stops_before_paying(in_process, tmp_path, monkeypatch):
    """Proves: the job compares the expected answer bytes (requests x max_tokens x bytes per token)
    with the cache filesystem's free space and stops before any request, naming path and numbers."""
    import eagledata.generate.preflight as preflight

    sim, cfg = in_process
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 50_000, 50_000))
    msg = _stopped(cfg, tmp_path)
    assert f"not enough free space for the cache {tmp_path / 'cache' / 'd' / 'responses.jsonl'}" in msg
    assert "50,000 bytes free" in msg
    assert sim.requests_total == 0
    # the estimate itself: body + max_tokens x bytes per token + overhead, per request
    assert preflight.expected_cache_bytes([100, 200], 300, stream=False) == 300 + 2 * (300 * 16 + 2048)
    assert preflight.expected_cache_bytes([0], 10, stream=True) == 10 * preflight.STREAM_BYTES_PER_TOKEN + 2048


def test_preflight_logs_and_passes_on_a_good_setup(in_process, tmp_path):
    from eagledata.generate.job import generate_dataset

    sim, cfg = in_process
    logs: list[str] = []
    assert generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)["requested"] == 5
    assert any(line.startswith("preflight d: tokenizer") and "5 prompt(s) render" in line for line in logs), logs
    assert sim.requests_total == 5


# --------------------------------------------------------------------------------------------
# 7. the JSON error column


def test_prompt_json_error_points_at_the_real_column(tmp_path):
    """Proves (generate entry in its own process): the reported column is the 1-based character
    column of the error in its line (non-ASCII before it counts once), and an error at the end of
    a line is reported on that line, not as column 1 of the next."""
    prompts = tmp_path / "p.jsonl"
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "ok"}]})
    bad = '{"id": "b", "messages": [{"role": "user", "content": "héllo wörld" "x"}]}'
    prompts.write_text(good + "\n" + bad + "\n")
    cfg = make_config(tmp_path, prompts, "unused", api_base="http://127.0.0.1:9/api/v1")
    code, log = run_generate(cfg, tmp_path)
    col = bad.index('"x"') + 1
    assert code == 1 and f"{prompts}:2:(json): invalid JSON: Expecting ',' delimiter at column {col} " in log, log
    with pytest.raises(json.JSONDecodeError) as real:
        json.loads(bad)
    assert real.value.colno == col  # the column json itself reports for the line alone

    cut = '{"id": "c", "messages": ['
    prompts.write_text(good + "\n" + cut + "\r\n")
    code, log = run_generate(cfg, tmp_path)
    assert code == 1 and f"{prompts}:2:(json): invalid JSON: Expecting value at column {len(cut) + 1} (end of line)" in log, log
