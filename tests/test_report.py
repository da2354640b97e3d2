"""HTML reports, run-wide validation.json and routing advice (eagledata.report.build), on synthetic token
shards built with the demo tokenizer (no ../shared needed)."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from eagledata.demo import tokenizer as dt
from eagledata.report import build as rp
from eagledata.report import highlight as hl
from eagledata.report import routing as ra
from eagledata.text.families import get_family
from eagledata.tokens.checks import REASONS
from eagledata.tokens.samples import tokenize_record
from eagledata.text.tokenizer import load_tokenizer
from eagledata.tokens.shards import build_token_shards
from eagledata.validate.summary import write_validation

ROOT = Path(__file__).resolve().parents[1]
FAMILY = get_family("kimi-k2.5")
MSGS = [{"role": "user", "content": "What is 2+3?"}]
R, C = " Two plus three.", " It is 5."
LITERAL = "say <|im_end|> and <script>alert('x')</script> & done"
VOID = {"<area>", "<base>", "<br>", "<col>", "<embed>", "<hr>", "<img>", "<input>", "<link>", "<meta>", "<source>", "<track>", "<wbr>"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = dt.build_demo_tokenizer(None, tmp_path_factory.mktemp("demo") / "tokenizer")
    return load_tokenizer(path, FAMILY)


def _record(rid, provider, content=C, reasoning=R, finish="stop", tool_calls=None, error=None):
    msg = {"role": "assistant", "content": content, "reasoning": reasoning}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    body = {"id": f"gen-{rid}", "provider": provider, "model": "moonshotai/kimi-k2.5",
            "choices": [{"index": 0, "finish_reason": finish, "message": msg}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
    if error:
        body = {"error": error}
    return {"id": rid, "request": {"model": "moonshotai/kimi-k2.5", "messages": MSGS}, "status": 200,
            "response_raw": json.dumps(body)}


def _bill(rec, tok, completion_delta=0, prompt_delta=0):
    """Set usage to our own counts plus deltas."""
    s = tokenize_record(rec, tok, FAMILY, rec["id"])
    body = json.loads(rec["response_raw"])
    body["usage"] = {"prompt_tokens": len(s.prompt_ids) + prompt_delta,
                     "completion_tokens": len(s.completion.ids) + completion_delta}
    rec["response_raw"] = json.dumps(body)
    return rec


def synthetic_records(tok):
    """Providers: 'Good AI' (exact, one repaired tool id, literal markup), 'Mid Cloud' (4 of 5 good),
    'Bad Host' (3 of 7 completions verified, one of them with a differing prompt), 'Few' (one truncated sample), and an error without a provider."""
    recs = [_bill(_record(f"good-{i}", "Good AI"), tok) for i in range(5)]
    recs.append(_bill(_record("rewritten", "Good AI", content="", finish="tool_calls",
                              tool_calls=[{"id": "call_9x", "type": "function",
                                           "function": {"name": "add", "arguments": "{\"a\": 2}"}}]), tok))
    recs.append(_bill(_record("literal", "Good AI", content=LITERAL), tok))
    recs += [_bill(_record(f"mid-{i}", "Mid Cloud"), tok) for i in range(4)]
    # the provider stripped a leading space that was a token of its own: billed one more than ours
    recs.append(_bill(_record("stripped", "Mid Cloud", content=C.lstrip()), tok, completion_delta=1))
    recs += [_bill(_record(f"bad-ok-{i}", "Bad Host"), tok) for i in range(2)]
    recs += [_bill(_record(f"bad-{i}", "Bad Host"), tok, completion_delta=3 + i) for i in range(4)]
    recs.append(_bill(_record("badprompt", "Bad Host"), tok, prompt_delta=7))
    recs.append(_bill(_record("truncated", "Few", content=" It is", finish="length"), tok))
    recs.append(_record("error200", "x", error={"code": 502, "message": "upstream <failed>"}))
    return recs


def build_dataset(tok, root: Path, name: str = "syn", records=None):
    """responses.jsonl -> tokens -> validation.json under ``root/name``; returns (validation, tokens)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    recs = records if records is not None else synthetic_records(tok)
    (d / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    build_token_shards(d / "responses.jsonl", d / "tokens", tok, FAMILY, name, shard_size=5)
    write_validation(d / "tokens", d / "validation.json", d / "validation.txt", 1.0)
    return d / "validation.json", d / "tokens"


class _Balance(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.ids = [], [], []

    def handle_starttag(self, tag, attrs):
        if f"<{tag}>" not in VOID:
            self.stack.append(tag)
        self.ids += [v for k, v in attrs if k == "id"]

    def handle_startendtag(self, tag, attrs):
        self.ids += [v for k, v in attrs if k == "id"]

    def handle_endtag(self, tag):
        if f"<{tag}>" in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()


def assert_well_formed(text: str) -> _Balance:
    p = _Balance()
    p.feed(text)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed: {p.stack}"
    assert len(p.ids) == len(set(p.ids)), "duplicate ids"
    assert "<script" not in text.lower(), "a report must carry no script (and escape the samples' <script>)"
    assert not re.search(r"(src|href)=\"https?:", text), "a report must not load anything from the network"
    return p


@pytest.fixture(scope="module")
def built(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    v1, t1 = build_dataset(tok, root, "syn")
    v2, t2 = build_dataset(tok, root, "syn2", [_bill(_record(f"x-{i}", "Good AI"), tok) for i in range(3)])
    ctx = rp.build_dataset_report(v1, t1, root / "syn" / "report.html", tok, {"worst_samples": 20, "min_samples": 5},
                                  run_report="../report.html")
    rp.build_dataset_report(v2, t2, root / "syn2" / "report.html", tok, {"min_samples": 5})
    run = rp.build_run_report({"syn": (v1, t1), "syn2": (v2, t2)}, root / "report.html", root / "validation.json",
                              root / "routing_advice.yaml", {"min_samples": 5},
                              {"syn": "syn/report.html", "syn2": "syn2/report.html"})
    return root, ctx, run


def _sample_html(text: str, sample_id: str) -> str:
    m = re.search(rf'<article class="sample" id="{re.escape(rp.anchor(sample_id))}">(.*?)</article>', text, re.S)
    assert m, f"sample {sample_id} not shown"
    return m.group(1)


def test_dataset_report_content(built, tok):
    root, ctx, _ = built
    text = (root / "syn" / "report.html").read_text(encoding="utf-8")
    assert_well_formed(text)
    v = json.loads((root / "syn" / "validation.json").read_text())
    for name in v["providers"]:
        assert f"<b>{name}</b>" in text
    c = v["counts"]
    assert f'<div class="n">{c["total"]}</div><div class="l">responses</div>' in text
    for k in ("exact", "repaired", "mismatch", "error"):
        assert re.search(rf'<div class="card {k}"><div class="n">{c[k]}</div>', text), k
    for code in v["reasons"]:
        assert f"<code>{code}</code>" in text
    assert "<svg" in text and "<rect" in text
    # the literal markup sample is exact (not shown), but every flagged sample with a distinct reason is
    shown = [s["id"] for s in ctx["samples"]]
    assert "literal" not in shown and {"truncated", "rewritten", "error200", "stripped", "badprompt"} <= set(shown)
    assert shown.index("bad-2") < shown.index("bad-0")  # largest |completion_diff| first
    assert shown.index("rewritten") == len(shown) - 1  # repaired after mismatch/error


def test_escaping_of_sample_text(tok, tmp_path):
    recs = [_bill(_record("lit", "P", content=LITERAL), tok, completion_delta=2)]
    v, t = build_dataset(tok, tmp_path, "esc", recs)
    rp.build_dataset_report(v, t, tmp_path / "r.html", tok)
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert_well_formed(text)
    body = _sample_html(text, "lit")
    # the model's literal '<|im_end|>' text is escaped plain tokens; the real end-of-turn is a chip
    assert "&lt;|" in body and "<|" not in body
    toks = re.search(r'<div class="toks">(.*?)</div>', body, re.S).group(1)
    assert LITERAL in html.unescape(re.sub(r"<[^>]+>", "", toks))  # shown verbatim, token by token
    chips = re.findall(r'<span class="t t\d k-end_of_turn sp[^"]*"[^>]*>([^<]*)</span>', body)
    assert chips == ["&lt;|im_end|&gt;"]


def _marked(body: str, level: str) -> list[str]:
    return re.findall(rf'<span class="t [^"]*m-{level}[^"]*" title="([^"]*)">', body)


def test_truncated_and_rebuilt_id_highlighted(built, tok):
    root, ctx, _ = built
    text = (root / "syn" / "report.html").read_text(encoding="utf-8")
    trunc = next(s for s in ctx["samples"] if s["id"] == "truncated")
    n = trunc["n_tokens"]
    body = _sample_html(text, "truncated")
    titles = _marked(body, "offending")
    assert titles and all(t.startswith(f"#{n - 1}") or f"\u2013{n - 1} " in t for t in titles), titles
    assert "truncated" in titles[0]
    body = _sample_html(text, "rewritten")
    repaired = _marked(body, "repair")
    assert repaired and all("tool_id" in t for t in repaired)
    shown = "".join(re.findall(r'm-repair[^"]*" title="[^"]*">([^<]*)<', body))
    assert shown == "functions.add:0"
    assert "call_9x" in body  # the provider's own id is listed
    # a count mismatch marks boundary tokens as suspect; a prompt mismatch marks none and says so
    assert _marked(_sample_html(text, "bad-2"), "suspect")
    bp = _sample_html(text, "badprompt")
    assert not re.search(r"m-(offending|suspect|repair)", bp) and "difference is in the prompt (ours minus billed: -7)" in bp


def test_implicated_positions_unit():
    segs = [{"kind": "reasoning", "start": 0, "end": 3, "text": "abc"}, {"kind": "think_close", "start": 3, "end": 4},
            {"kind": "content", "start": 4, "end": 6, "text": "de"}, {"kind": "end_of_turn", "start": 6, "end": 7}]
    ids = list(range(7))
    imp = hl.implicated_tokens("completion_count_mismatch", ids, segs, completion_diff=1)
    assert imp.level == "suspect" and imp.positions == [0, 4, 6]
    assert hl.implicated_tokens("completion_count_mismatch", ids, segs, completion_diff=3).positions == [0, 4]
    assert hl.implicated_tokens("truncated", ids[:6], segs[:3]).positions == [5]
    assert hl.implicated_tokens("end_of_turn_misplaced", ids, segs).positions == [6]
    assert hl.implicated_tokens("lossy_text", ids, segs, unit_texts={2: "x\ufffd", 5: "ok"}).positions == [2]
    assert hl.implicated_tokens("special_in_text", ids, segs, is_special=lambda t: t == 5).positions == [5]
    assert hl.implicated_tokens("decode_mismatch", ids, segs, decode=lambda x: "abc" if x == [0, 1, 2] else "??").positions == [4, 5]
    none = hl.implicated_tokens("prompt_count_mismatch", ids, segs, prompt_diff=-3)
    assert none.level is None and none.positions == [] and "-3" in none.note
    assert set(hl.IMPLICATED) >= {c for c in REASONS}, "every reason code says which tokens it marks"


def test_run_report_and_validation_json(built):
    root, _, run = built
    text = (root / "report.html").read_text(encoding="utf-8")
    assert_well_formed(text)
    agg = json.loads((root / "validation.json").read_text())
    parts = [json.loads((root / n / "validation.json").read_text()) for n in ("syn", "syn2")]
    for k in ("total", "exact", "repaired", "mismatch", "error", "excluded", "included"):
        assert agg["counts"][k] == sum(p["counts"][k] for p in parts), k
    assert agg["providers"]["Good AI"]["total"] == 7 + 3
    assert agg["providers"]["Good AI"]["exact"] == parts[0]["providers"]["Good AI"]["exact"] + 3
    assert agg["reasons"]["truncated"]["ids"] == {"syn": ["truncated"]}
    assert set(agg["datasets"]) == {"syn", "syn2"} and agg["passed"] is True
    assert 'href="syn/report.html"' in text and f'href="syn/report.html#{rp.anchor("truncated")}"' in text
    for name in agg["providers"]:
        assert f"<b>{name}</b>" in text


def test_routing_advice_orders_by_share_and_ignores_bad(built):
    root, _, run = built
    advice = yaml.safe_load((root / "routing_advice.yaml").read_text())
    assert advice == {"provider": {"order": ["goodai", "midcloud"], "ignore": ["badhost"]}}
    decisions = {r["name"]: r["decision"] for r in run["advice"]["providers"]}
    assert decisions["Few"] == "too_few_samples" and decisions["unknown"] == "not_routable"
    text = (root / "routing_advice.yaml").read_text()
    assert "paste" in text.lower() and "generation:" in text
    # the advice is a valid generation.provider block for the config schema
    from eagledata.config import validate_config
    cfg = {"models": {"m": {"family": "kimi-k2.5", "tokenizer": "x"}},
           "datasets": {"d": {"model": "m", "prompts": "p.jsonl"}}, "generation": advice}
    assert validate_config(cfg)["generation"]["provider"]["order"] == ["goodai", "midcloud"]


def test_routing_advice_rules():
    assert ra.provider_slug("Moonshot AI") == "moonshotai"
    assert ra.provider_slug("DeepInfra") == "deepinfra" and ra.provider_slug("SiliconFlow") == "siliconflow"
    provs = {"A": {"total": 10, "exact": 9, "repaired": 0}, "B": {"total": 10, "exact": 5, "repaired": 5},
             "C": {"total": 20, "exact": 19, "repaired": 0}, "D": {"total": 10, "exact": 1, "repaired": 0},
             "E": {"total": 2, "exact": 2, "repaired": 0}}
    a = ra.routing_advice(provs, min_samples=5, ignore_below=0.5)
    assert a["order"] == ["b", "c", "a"] and a["ignore"] == ["d"]
    # never ignore every provider (that config would fail every request): only those with nothing good
    a = ra.routing_advice({"X": {"total": 10, "exact": 1}, "Y": {"total": 10, "exact": 3}, "Z": {"total": 9}}, 5, 0.5)
    assert a["order"] == ["y", "x"] and a["ignore"] == ["z"] and a["notes"]
    # no verified completion anywhere: nothing advised, nothing ignored, and the advice says so
    a = ra.routing_advice({"X": {"total": 10}, "Y": {"total": 10}}, 5, 0.5)
    assert a["ignore"] == [] and a["order"] == [] and a["notes"]
    assert {r["decision"] for r in a["providers"]} == {"no_verified_completion"}
    # equal shares: the completion-side share breaks the tie
    a = ra.routing_advice({"P": {"total": 10, "exact": 8, "completion_verified": 8},
                           "Q": {"total": 10, "exact": 8, "completion_verified": 10}}, 5, 0.5)
    assert a["order"] == ["q", "p"]


def test_report_settings():
    assert rp.report_settings({})["worst_samples"] == rp.REPORT_DEFAULTS["worst_samples"]
    assert rp.report_settings({"report": {"worst_samples": 3}})["worst_samples"] == 3
    with pytest.raises(ValueError, match="unknown"):
        rp.report_settings({"report": {"worst": 3}})


def test_long_completion_is_elided_around_marks(tok, tmp_path):
    long = " ".join(f"word{i}" for i in range(900))
    recs = [_bill(_record("long", "P", content=long, finish="length"), tok)]
    v, t = build_dataset(tok, tmp_path, "long", recs)
    ctx = rp.build_dataset_report(v, t, tmp_path / "r.html", tok, {"max_tokens_shown": 300})
    body = _sample_html((tmp_path / "r.html").read_text(encoding="utf-8"), "long")
    assert "tokens \u2026</span>" in body and _marked(body, "offending")
    assert ctx["samples"][0]["n_tokens"] > 300


def test_unicode_pieces_are_joined(tok):
    ids = tok.encode_plain("你好 ok")
    units = hl.token_units(ids, tok)
    assert "".join(u.text for u in units) == "你好 ok"
    assert all(not u.raw for u in units) and any(u.end - u.start > 1 for u in units)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium on PATH (not required in CI)")
def test_renders_in_headless_chromium(built, tmp_path):
    root, _, _ = built
    for html_file in (root / "report.html", root / "syn" / "report.html"):
        png = tmp_path / (html_file.parent.name + ".png")
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshot_report.py"), str(html_file), str(png),
                               "--height", "1600"], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.shared
def test_report_on_recorded_traffic(k2, recorded, tmp_path):
    """The real recorded OpenRouter traffic: every provider with its learned convention is listed."""
    tok, fam = k2
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recorded), encoding="utf-8")
    build_token_shards(path, tmp_path / "tokens", tok, fam, "recorded", shard_size=100)
    write_validation(tmp_path / "tokens", tmp_path / "validation.json", tmp_path / "validation.txt", 1.0)
    ctx = rp.build_dataset_report(tmp_path / "validation.json", tmp_path / "tokens", tmp_path / "report.html", tok)
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert_well_formed(text)
    v = json.loads((tmp_path / "validation.json").read_text())
    for name, p in v["providers"].items():
        row = re.search(rf"<b>{re.escape(name)}</b>.*?</tr>", text, re.S)
        assert row and f"<code>{p['convention']}</code>" in row.group(0), name
    assert len(ctx["samples"]) == min(rp.REPORT_DEFAULTS["worst_samples"], ctx["n_flagged"])


@pytest.mark.workflow
def test_report_rules_and_snakemake_report(demo_run, tmp_path):
    """`snakemake report` on the demo builds every report; `snakemake --report` embeds them. On a copy of
    the finished demo run (tests/conftest.py) with every report deleted: the report jobs rebuild them."""
    from workflow_runs import copy_run

    work = copy_run(demo_run, tmp_path / "wf")
    datasets = list(yaml.safe_load((work / "config/config.yaml").read_text())["datasets"])
    reports = ["results/report.html", "results/validation.json", "results/routing_advice.yaml"]
    for path in reports + [f"results/{d}/report.html" for d in datasets]:
        (work / path).unlink()

    def snakemake(workdir, *args, check=True):
        proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir,
                              capture_output=True, text=True, timeout=900)
        assert not check or proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
        return proc

    snakemake(work, "report")
    for path in ["results/report.html"] + [f"results/{d}/report.html" for d in datasets]:
        assert_well_formed((work / path).read_text(encoding="utf-8"))
    run = json.loads((work / "results/validation.json").read_text())
    assert run["counts"]["total"] == sum(json.loads((work / f"results/{d}/validation.json").read_text())["counts"]["total"]
                                         for d in datasets)
    assert yaml.safe_load((work / "results/routing_advice.yaml").read_text())["provider"]["order"]
    snakemake(work, "--report", "report.zip", "report")
    names = zipfile.ZipFile(work / "report.zip").namelist()
    assert sum(n.endswith("/report.html") for n in names) >= 3 and any(n.endswith("routing_advice.yaml") for n in names)
    lint = snakemake(work, "--lint", check=False)
    assert "Congratulations" in lint.stdout + lint.stderr, (lint.stdout + lint.stderr)[-3000:]


def test_reports_outside_snakemake_after_failed_validation(tok, tmp_path):
    """`python -m eagledata.report.build` still reports a dataset whose validate rule failed (Snakemake
    removed its validation.json): the summary is rebuilt from the token shards."""
    from eagledata.config import validate_config

    results = tmp_path / "results"
    build_dataset(tok, results, "syn")
    (results / "syn" / "validation.json").unlink()
    config = validate_config({"results_dir": str(results), "validation": {"max_bad_fraction": 0.05},
                              "models": {"demo": {"family": "kimi-k2.5", "tokenizer": tok.source}},
                              "datasets": {"syn": {"model": "demo", "responses": "unused.jsonl"},
                                           "never_ran": {"model": "demo", "responses": "unused.jsonl"}}})
    ctx = rp.build_reports_from_config(config, tmp_path / "out")
    assert [d["name"] for d in ctx["datasets"]] == ["syn"] and ctx["v"]["passed"] is False
    text = (tmp_path / "out" / "syn" / "report.html").read_text(encoding="utf-8")
    assert_well_formed(text)
    assert '<span class="badge fail">FAILED</span>' in text
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["counts"]["total"] == len(synthetic_records(tok))
