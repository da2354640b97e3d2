"""The shape of the library: one package per stage, no import cycles, modules of one concept (under
about 800 lines), no private name imported across modules, one exception hierarchy, derived code
inputs."""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import re
from pathlib import Path

import pytest

from eagledata.codeinputs import stage_code, write_stamp

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "eagledata"
STAGES = ("text", "generate", "tokens", "validate", "extract", "export", "report", "standin", "demo")
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


def _top_level_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules imported when ``name`` is imported (statements run at import time)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(node, ast.ClassDef):
                    visit(node.body)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


def test_one_package_per_stage_with_a_docstring():
    for stage in STAGES:
        init = PKG / stage / "__init__.py"
        assert init.is_file(), stage
        assert ast.get_docstring(ast.parse(init.read_text())), f"{stage}/__init__.py states what the package holds"


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _top_level_imports(path, name, modules) for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how re-exports work, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_stay_small():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_no_private_name_imported_across_modules():
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagledata") or (
                    isinstance(node, ast.ImportFrom) and node.level):
                offenders += [f"{path.relative_to(PKG)}: {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders


def test_every_error_derives_from_the_common_base():
    import importlib

    from eagledata.errors import EagledataError

    loose = []
    for name, path in _modules().items():
        if path.name == "__main__.py" or "torch" in path.read_text(encoding="utf-8").split("def ")[0]:
            continue  # modules importing torch at import time are checked where torch is tested
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == name
                    and not issubclass(obj, EagledataError) and not attr.startswith("_")):
                loose.append(f"{name}.{attr}")
    assert not loose, f"exceptions outside the eagledata.errors hierarchy: {loose}"


def test_code_inputs_follow_imports_transitively(tmp_path):
    pkg = tmp_path / "src" / "eagledata"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from .b import x\n")
    (pkg / "a" / "b.py").write_text("import json\nfrom ..c import y\nx = 1\n")
    (pkg / "c.py").write_text("def f():\n    from eagledata.d import z  # lazy imports count too\ny = 2\n")
    (pkg / "d.py").write_text("z = 3\n")
    (pkg / "unused.py").write_text("")
    script = tmp_path / "script.py"
    script.write_text("from eagledata.a import x\n")
    got = stage_code(script, pkg, tmp_path)
    assert got == sorted(f"src/eagledata/{p}" for p in ("__init__.py", "a/__init__.py", "a/b.py", "c.py", "d.py"))


def test_code_inputs_follow_an_edited_import(tmp_path):
    """The parsed imports are remembered per file version: a module that starts importing another is seen."""
    pkg = tmp_path / "src" / "eagledata"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("y = 2\n")
    script = tmp_path / "script.py"
    script.write_text("from eagledata.a import x\n")
    assert stage_code(script, pkg, tmp_path) == ["src/eagledata/__init__.py", "src/eagledata/a.py"]
    (pkg / "a.py").write_text("from eagledata.b import y\nx = 1\n")
    assert stage_code(script, pkg, tmp_path) == ["src/eagledata/__init__.py", "src/eagledata/a.py", "src/eagledata/b.py"]


def test_code_inputs_from_the_import_cache_follow_an_edited_import(tmp_path):
    """Imports parsed by an earlier process are kept on disk per file content: a later process gets the
    same files, and one whose module changed (same size, same mtime) parses it again."""
    import os
    import subprocess
    import sys
    pkg = tmp_path / "src" / "eagledata"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from eagledata.c import y\n")
    (pkg / "b.py").write_text("y = 2\n")
    (pkg / "c.py").write_text("y = 2\n")
    script = tmp_path / "script.py"
    script.write_text("from eagledata.a import x\n")
    cache = tmp_path / ".snakemake" / "imports.json"
    code = ("import json, sys; from eagledata.codeinputs import stage_code; "
            "print(json.dumps(stage_code(sys.argv[1], sys.argv[2], sys.argv[3], cache_file=sys.argv[4])))")

    def in_new_process():
        out = subprocess.run([sys.executable, "-c", code, str(script), str(pkg), str(tmp_path), str(cache)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    first = in_new_process()
    assert first == stage_code(script, pkg, tmp_path) == ["src/eagledata/__init__.py", "src/eagledata/a.py", "src/eagledata/c.py"]
    assert str(pkg / "a.py") in json.loads(cache.read_text())
    assert in_new_process() == first
    st = os.stat(pkg / "a.py")
    (pkg / "a.py").write_text("from eagledata.b import y\n")  # same size
    os.utime(pkg / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))  # and mtime
    assert in_new_process() == ["src/eagledata/__init__.py", "src/eagledata/a.py", "src/eagledata/b.py"]
    cache.write_text(json.dumps({str(pkg / "a.py"): "not an entry", str(pkg / "c.py"): [1]}))  # damaged: parsed again
    assert in_new_process() == ["src/eagledata/__init__.py", "src/eagledata/a.py", "src/eagledata/b.py"]
    cache.write_text("{not json")
    assert in_new_process() == ["src/eagledata/__init__.py", "src/eagledata/a.py", "src/eagledata/b.py"]


def test_a_stamp_changes_with_content_only(tmp_path):
    """A stamp hashes file contents (a directory: every file under it), so a rewrite with the same
    bytes gives the same stamp and any edit a different one."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("a 1\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    inputs = [tmp_path / "m.py", tmp_path / "tok"]
    first = write_stamp(inputs, tmp_path / "s" / "stamp")
    (tmp_path / "m.py").write_text("x = 1\n")
    assert write_stamp(inputs, tmp_path / "s" / "stamp") == first
    assert f"{tmp_path / 'tok' / 'vocab.txt'}" in (tmp_path / "s" / "stamp").read_text()
    (tmp_path / "tok" / "vocab.txt").write_text("a 2\n")
    assert write_stamp(inputs, tmp_path / "s" / "stamp") != first


def test_a_stamp_is_rewritten_only_when_its_content_changes(tmp_path):
    """The workflow writes its stamps at every start: one whose content is unchanged keeps its file and
    mtime (Snakemake judges a newer stamp by its checksum, but a job downstream of one that must run is
    not judged at all); a named file (``built``) and the settings are part of the content."""
    (tmp_path / "m.py").write_text("x = 1\n")
    out = tmp_path / "s" / "stamp"
    first = write_stamp([tmp_path / "m.py"], out, settings={"family": "k"}, built=["results/_assets/tok"])
    os.utime(out, ns=(1, 1))
    (tmp_path / "m.py").write_text("x = 1  # a comment\n")
    assert write_stamp([tmp_path / "m.py"], out, settings={"family": "k"}, built=["results/_assets/tok"]) == first
    assert out.stat().st_mtime_ns == 1
    assert "built  results/_assets/tok\n" in out.read_text()
    for change in ({"settings": {"family": "k2"}, "built": ["results/_assets/tok"]}, {"settings": {"family": "k"}},
                   {"built": ["results/_assets/tok"]}):
        assert write_stamp([tmp_path / "m.py"], out, **change) != first, change
        assert out.stat().st_mtime_ns != 1
        os.utime(out, ns=(1, 1))


def test_stamps_are_named_by_their_content_and_never_rewritten(tmp_path):
    """stamp_file: ``{name}.{digest16}.sha256``, one file per content, never rewritten (a Snakemake
    started while jobs run cannot change what they declared) nor removed; a content current again after
    another is made the newest (touched), so outputs made with the other are older than it."""
    from eagledata.codeinputs import stamp_file

    module, stamps = tmp_path / "m.py", tmp_path / "stamps"
    module.write_text("x = 1\n")
    first = stamp_file([module], stamps, "s")
    assert first.name == f"s.{first.read_text().splitlines()[-1][:16]}.sha256"
    os.utime(first, ns=(10**9, 10**9))
    assert stamp_file([module], stamps, "s") == first and first.stat().st_mtime_ns == 10**9  # left as it was
    module.write_text("x = 2\n")
    second = stamp_file([module], stamps, "s")
    assert second != first and first.stat().st_mtime_ns == 10**9
    module.write_text("x = 1\n")  # reverted: the first is current again, and the newest
    assert stamp_file([module], stamps, "s") == first and first.stat().st_mtime_ns > second.stat().st_mtime_ns
    assert second.is_file()
    assert stamp_file([module], stamps, "s", settings={"k": 1}) not in (first, second)


def test_a_stamp_is_the_same_from_any_working_directory(tmp_path, monkeypatch):
    """Files inside the workflow's directory (``base``) are named relative to it, so the same code gives
    the same stamp (and extraction the same code fingerprint) whether Snakemake runs in the workflow's
    directory or elsewhere (``snakemake -s .../Snakefile --directory run``: absolute paths)."""
    from eagledata.codeinputs import stamp_file

    flow, run = tmp_path / "flow", tmp_path / "run"
    (flow / "src" / "eagledata").mkdir(parents=True)
    run.mkdir()
    (flow / "src" / "eagledata" / "io.py").write_text("x = 1\n")
    monkeypatch.chdir(flow)
    here = stamp_file(["src/eagledata/io.py"], tmp_path / "a", "s", base=flow)
    monkeypatch.chdir(run)
    there = stamp_file([str(flow / "src/eagledata/io.py")], tmp_path / "b", "s", base=flow)
    assert here.name == there.name and here.read_text() == there.read_text()
    assert "  src/eagledata/io.py\n" in here.read_text()
    assert stamp_file([str(flow / "src/eagledata/io.py")], tmp_path / "c", "s").name != here.name  # no base: as given


def test_a_job_that_ran_other_code_than_its_stamps_record_fails(tmp_path):
    """verify_loaded_code: every project module loaded in this process must be, by its code, the one the
    stamps record (a stage stamp's code stamps followed); another digest, or a loaded module no stamp
    names, raises CodeChangedError naming it."""
    import sys

    from eagledata.codeinputs import CodeChangedError, stamp_file, verify_loaded_code

    loaded = sorted(m.__file__ for n, m in sys.modules.items()
                    if (n == "eagledata" or n.startswith("eagledata.")) and getattr(m, "__file__", None))
    code = stamp_file(loaded, tmp_path / "scripts", "all")
    stage = stamp_file([code], tmp_path / "datasets", "tokens", settings={"family": "k"})
    verify_loaded_code([stage], cache_file=None, checked=set())
    io_file = sys.modules["eagledata.io"].__file__
    edited = tmp_path / "edited"
    edited.write_text("\n".join(line if not line.endswith("  " + io_file) else "0" * 64 + "  " + io_file
                                for line in code.read_text().splitlines()) + "\n")
    with pytest.raises(CodeChangedError, match=r"eagledata\.io \("):
        verify_loaded_code([edited], cache_file=None, checked=set())
    partial = stamp_file([f for f in loaded if f != io_file], tmp_path / "scripts", "partial")
    with pytest.raises(CodeChangedError, match=r"eagledata\.io .*in no stamp"):
        verify_loaded_code([partial], cache_file=None, checked=set())
    checked = set()
    verify_loaded_code([code], cache_file=None, checked=checked)  # what a job checked once is not checked again
    verify_loaded_code([edited], cache_file=None, checked=checked)


def test_a_process_a_job_spawned_checks_its_code_against_the_jobs_stamps(tmp_path):
    """A job's first check with ``children`` puts its stamps in the environment; a process it spawns
    (judging workers, a large file's readers, SGLang's ranks: each calls verify_inherited_code when it
    starts) checks the code it imported against them and fails on another digest; outside a job it
    checks nothing."""
    import subprocess
    import sys

    from eagledata.codeinputs import JOB_STAMPS_ENV, stamp_file
    from eagledata.extract import sglang
    from eagledata.tokens import pershard, planscan

    for entry in (pershard._helper_init, planscan.scan_range, sglang._rank_main):
        assert "verify_inherited_code()" in inspect.getsource(entry), entry
    child = "import eagledata.io; from eagledata.codeinputs import verify_inherited_code; verify_inherited_code()"
    files = [str(PKG / p) for p in ("__init__.py", "io.py", "errors.py", "codeinputs.py")]
    good = stamp_file(files, tmp_path / "s", "good")
    bad = tmp_path / "bad.sha256"
    bad.write_text("".join(("0" * 64 + "  " + line.split("  ", 1)[1] if line.endswith("io.py") else line) + "\n"
                           for line in good.read_text().splitlines()))

    def spawned(stamps):
        env = {**os.environ, **({JOB_STAMPS_ENV: json.dumps([str(stamps)])} if stamps else {})}
        env.pop(JOB_STAMPS_ENV, None) if stamps is None else None
        return subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)

    assert spawned(good).returncode == 0
    failed = spawned(bad)
    assert failed.returncode != 0 and "CodeChangedError" in failed.stderr and "eagledata.io" in failed.stderr
    assert spawned(None).returncode == 0


def test_a_code_digest_cache_gives_what_the_module_gives(tmp_path):
    """Code digests kept by the sha256 of a module's bytes (the workflow cuts every module's text at
    each start otherwise): a cached digest is the computed one, an edited module gets its own, and a
    cache that cannot be read is ignored."""
    from eagledata.codeinputs import code_digest

    module, cache = tmp_path / "m.py", str(tmp_path / "cache" / "digests.json")
    module.write_text("x = 1  # c\n")
    first = code_digest(module, cache)
    write_stamp([module], tmp_path / "stamp", cache_file=cache)  # saves the cache
    [(key, cached)] = json.loads(Path(cache).read_text()).items()
    assert key.endswith(":" + hashlib.sha256(module.read_bytes()).hexdigest()) and cached == first
    assert first == code_digest(module) == code_digest(module, cache)
    module.write_text("x = 2  # c\n")
    assert code_digest(module, cache) == code_digest(module) != first
    (tmp_path / "other.json").write_text("{not json")
    assert code_digest(module, str(tmp_path / "other.json")) == code_digest(module)


def test_no_module_holds_the_version():
    """The version is the installed distribution's (pyproject.toml): a module that wrote it would be
    code every stamp counts, and a release would rerun every stage and re-extract every hidden state."""
    from importlib.metadata import version

    import eagledata

    assert eagledata.__version__ == version("eagledata")
    holders = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert holders == []


BASE_MODULE = '''"""Module doc."""
import os  # why


def f(x):
    """Doc of f, \u00e9."""; y = "# not a comment"
    return x + 1
'''


def test_a_module_counts_in_a_stamp_by_its_code_only(tmp_path):
    """Comments, docstrings, trailing space and blank lines of a module leave its stamp as it was (the
    resume key of stored hidden states is a stamp's content); any change of code, among them a string
    that only looks like a comment and a statement sharing a docstring's line, gives another."""
    module = tmp_path / "m.py"

    def stamp(text):
        module.write_text(text, encoding="utf-8")
        return write_stamp([module], tmp_path / "stamp")

    first = stamp(BASE_MODULE)
    for same in (BASE_MODULE.replace("# why", "# another reason"), BASE_MODULE.replace("Doc of f, \u00e9.", "Other"),
                 BASE_MODULE.replace('"""Module doc."""', "'Doc'") + "\n\n   \n", BASE_MODULE.replace("x + 1", "x + 1   ")):
        assert stamp(same) == first, same
    for other in (BASE_MODULE.replace("x + 1", "x + 2"), BASE_MODULE.replace('"# not a comment"', '""'),
                  BASE_MODULE.replace('y = "# not a comment"', 'y = 2'), BASE_MODULE.replace("import os", "import sys")):
        assert stamp(other) != first, other
    assert stamp("def broken(:\n") != stamp("def broken(:  \n")  # not Python: byte for byte
    # lines end at line breaks only: a form feed (a page break PEP 8 allows) or a U+2028 in a string
    # does not shift what is cut; CRLF line ends are line ends
    for text in ('x = 1\n\x0c\n"""Doc."""\ny = 2  # c\n', 's = "\u2028\x0c"; t = 1  # c\ny = 2\n'):
        assert stamp(text) != stamp(text.replace("y = 2", "y = 3")), text
        assert stamp(text) == stamp(text.replace("# c", "# d")) == stamp(text.replace("\n", "\r\n")), text
    # inside a string of several lines, trailing space and blank lines are the string's value
    for a, b in (('S = """a  \nb"""\n', 'S = """a\nb"""\n'), ('S = """a\n\nb"""\n', 'S = """a\nb"""\n'),
                 ('S = f"""a  \n{x}\nb"""\n', 'S = f"""a\n{x}\nb"""\n')):
        assert stamp(a) != stamp(b), a
    # a module in another declared encoding counts byte for byte (its text is not UTF-8's)
    module.write_bytes("# -*- coding: latin-1 -*-\nx = '\u00e9'\n".encode("utf-8"))
    latin = write_stamp([module], tmp_path / "stamp")
    assert stamp("# -*- coding: utf-8 -*-\nx = '\u00e9'\n") != latin


@pytest.mark.parametrize("script", ["tokens.py", "validate.py", "report.py", "export.py", "extract.py"])
def test_stage_scripts_reach_their_package_in_one_hop(script):
    """rules/X.smk -> scripts/X.py -> eagledata/X/: the stage's own package is among its code inputs."""
    stage = script.removesuffix(".py")
    files = stage_code(ROOT / "scripts" / script, PKG, ROOT)
    assert any(f.startswith(f"src/eagledata/{stage}/") for f in files), files
    assert (ROOT / "rules" / f"{stage}.smk").is_file()


def test_one_cli_with_every_subcommand():
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "eagledata.cli", *args], capture_output=True, text=True, timeout=60)

    top = cli("--help")
    for name in ("explain", "profiles", "plan", "budget", "standin", "gpus", "report"):
        assert name in top.stdout, name
    standin = cli("standin", "--help")  # options after the name are the stand-in's own
    assert standin.returncode == 0 and "--tokenizer" in standin.stdout and "--profile" in standin.stdout
    gpus = cli("gpus", "0")
    assert gpus.returncode == 0 and gpus.stdout.strip() == ""


def test_functions_do_one_step():
    """No function runs past 80 lines (longer ones mix steps)."""
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(PKG)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
