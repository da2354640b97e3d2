"""Code inputs of a workflow rule, derived from what its script imports.

Contract: :func:`stage_code` returns every project module file (``eagledata/**.py``) that a rule's
script imports, directly or through other project modules, including the ``__init__.py`` of every
package on the way, sorted. A rule that declares them as inputs reruns when any of them changes, and
only then. Imports are read statically (``ast``), so imports inside functions count too; data files a
module reads (templates, the corpus) are not imports and stay listed by the rule.

Why our own code: Python's ``modulefinder`` executes no code either, but follows every third-party
and standard-library import (slow for a dry run of many jobs) and does not resolve the project's
package from a checkout other than the installed one.

Stamps: a rule does not declare those files itself. :func:`stamp_file` hashes them into one small
file, and the rule declares that stamp, so a workflow of thousands of per-shard jobs builds one input
per job instead of some 25 (the dry run's cost). The workflow writes its stamps while it is parsed
(rules/common.smk), named by their content (``{name}.{digest16}.sha256``): a stamp is a source file,
not a job's output (a stamp job that ran reran every job declaring it, whatever it wrote), and it is
never rewritten, so a Snakemake started while jobs run (a dry run) cannot change what a running job
declared: a code change gives the rules another input (Snakemake's input trigger), a revert the one
their outputs recorded. A module counts in a stamp by its code only (:func:`code_digest`: comments
and docstrings left out), so such an edit reruns nothing, and a job that keys stored results on a
stamp's content (extraction's resume key) keeps them.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import re
import sys
import tokenize
from functools import lru_cache
from pathlib import Path
from typing import Any

from eagledata.errors import StageError
from eagledata.io import atomic_write_text, sha256_text

PACKAGE = "eagledata"
#: the workflow's cache of code digests (relative to its working directory, where its jobs run too)
DIGESTS_CACHE = ".snakemake/eagledata/digests.json"


class CodeChangedError(StageError):
    """A job ran other code than the stamps it declared record (edited while the workflow ran, or an
    installed package that is not the checkout): its results would be recorded as the stamps' code's."""


def _module_file(package_dir: Path, dotted: str) -> Path | None:
    """The file of ``eagledata.a.b`` (``a/b.py`` or ``a/b/__init__.py``), or ``None``."""
    parts = dotted.split(".")[1:]
    base = package_dir.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted_of(package_dir: Path, path: Path) -> str:
    rel = path.relative_to(package_dir).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def _imported(tree: ast.AST, current: str | None, is_package: bool) -> set[str]:
    """Dotted names of project modules (and candidate submodules) imported in ``tree``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if current is None:
                    continue
                base = current.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != PACKAGE:
                continue
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _imports_of(path: Path, current: str | None, cache_file: str | None) -> list[str]:
    """The dotted project names ``path`` imports (:func:`_imported`), from the cache in ``cache_file``
    when it holds them for this content (key: the file's path; value: the sha256 of its bytes and the
    names)."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    key = str(path)
    cache = _file_cache(cache_file)
    hit = cache.get(key) if cache is not None else None
    if isinstance(hit, list) and len(hit) == 2 and hit[0] == digest and isinstance(hit[1], list):
        return hit[1]
    names = sorted(_imported(ast.parse(data.decode("utf-8"), key), current, path.name == "__init__.py"))
    if cache is not None:
        cache[key] = [digest, names]
        _CHANGED.add(cache_file)
    return names


@lru_cache(maxsize=None)
def _direct(package_dir: Path, path: Path, mtime_ns: int, size: int, cache_file: str | None) -> tuple[Path, ...]:
    """Project module files ``path`` imports directly (packages on the way included), parsed once per
    file version: the rules of one workflow share most of their modules."""
    inside = package_dir in path.parents
    current = _dotted_of(package_dir, path) if inside else None
    found: dict[Path, None] = {}
    for dotted in _imports_of(path, current, cache_file):
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way are imported too
            module = _module_file(package_dir, ".".join(parts[:i]))
            if module is not None:
                found[module] = None
    return tuple(found)


_FILE_CACHES: dict[str, dict[str, Any]] = {}
_CHANGED: set[str] = set()  # cache files this process added entries to since it last wrote them


def _file_cache(cache_file: str | None) -> dict[str, Any] | None:
    """What earlier processes parsed into ``cache_file`` (imports, or code digests), read once per
    process; an unreadable file is empty."""
    if cache_file is None:
        return None
    if cache_file not in _FILE_CACHES:
        try:
            loaded = json.loads(Path(cache_file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = {}
        _FILE_CACHES[cache_file] = loaded if isinstance(loaded, dict) else {}
    return _FILE_CACHES[cache_file]


def _closure(package_dir: Path, start: Path, cache_file: str | None = None) -> tuple[str, ...]:
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        st = path.stat()
        for found in _direct(package_dir, path, st.st_mtime_ns, st.st_size, cache_file):
            if found not in seen:
                seen.add(found)
                todo.append(found)
    _save_cache(cache_file)
    return tuple(sorted(str(p) for p in seen))


def _save_cache(cache_file: str | None) -> None:
    """Write ``cache_file``'s entries when this process added some."""
    if cache_file in _CHANGED:
        _CHANGED.discard(cache_file)
        try:
            Path(cache_file).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache_file, json.dumps(_FILE_CACHES[cache_file], sort_keys=True))
        except OSError:
            pass  # a cache: the next process parses again


def stage_code(script: str | Path, package_dir: str | Path, relative_to: str | Path | None = None,
               cache_file: str | Path | None = None) -> list[str]:
    """Project module files ``script`` imports (transitively) from the package at ``package_dir``;
    paths relative to ``relative_to`` when given (a workflow's directory). With ``cache_file``, the
    imports of each file version (by the sha256 of its bytes) are kept there between processes: parsing
    every module's source was a tenth of a dry run."""
    files = _closure(Path(package_dir).resolve(), Path(script).resolve(), None if cache_file is None else str(cache_file))
    if relative_to is None:
        return list(files)
    base = Path(relative_to).resolve()
    return [str(Path(f).relative_to(base)) if base in Path(f).parents else f for f in files]


def package_dir_for(workflow_dir: str | Path) -> Path:
    """The project package a workflow's rules depend on: the checkout's ``src/eagledata`` next to the
    Snakefile when there is one, else the installed package."""
    local = Path(workflow_dir) / "src" / PACKAGE
    if (local / "__init__.py").is_file():
        return local
    import eagledata

    return Path(eagledata.__file__).resolve().parent


# What :func:`_code_text` keeps of a module, as a cache key's prefix: change it with what it keeps, so
# that no digest cached by an older version is taken for this one's.
_CODE_TEXT_VERSION = "code-text-1"


def code_digest(path: str | Path, cache_file: str | None = None) -> str:
    """The sha256 of a file; of a Python module, of its code only: its text without comments and
    docstrings, each line without trailing space, blank lines left out, but for the lines inside a
    string of several lines, kept as they are (the same text under every Python version: spans cut
    from the source, not a token or AST dump). Code that reads a docstring (an argparse description)
    is not told apart. A module that does not parse, or declares another encoding than UTF-8, counts
    byte for byte. With ``cache_file``, a module's digest is kept there by the sha256 of its bytes
    (cutting a module's text is about 4 ms, and a workflow stamps every module at each start)."""
    data = Path(path).read_bytes()
    if Path(path).suffix != ".py":
        return hashlib.sha256(data).hexdigest()
    cache = _file_cache(cache_file)
    raw = f"{_CODE_TEXT_VERSION}:{hashlib.sha256(data).hexdigest()}"
    hit = cache.get(raw) if cache is not None else None
    if isinstance(hit, str):
        return hit
    try:
        text = _code_text(data)
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError, ValueError):
        text = None
    digest = hashlib.sha256(data if text is None else text.encode("utf-8")).hexdigest()
    if cache is not None:
        cache[raw] = digest
        _CHANGED.add(cache_file)
    return digest


def _code_text(data: bytes) -> str | None:
    """:func:`code_digest`'s text of a module's bytes; None for one declaring another encoding."""
    if tokenize.detect_encoding(io.BytesIO(data).readline)[0] != "utf-8":
        return None
    # lines end at line breaks only (str.splitlines would also cut at a form feed, as no parser does)
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    lines = _lines(text)
    starts = _line_starts(lines)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    docstrings = _docstring_spans(text, lines, starts)
    doc_starts = {start for start, _ in docstrings}
    spans = sorted(docstrings + [(starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
                                 for t in tokens if t.type == tokenize.COMMENT])
    inside: set[int] = set()  # rows whose line break lies inside a string (not a docstring)
    for t in tokens:
        if t.start[0] < t.end[0] and t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT) \
                and starts[t.start[0] - 1] + t.start[1] not in doc_starts:
            inside.update(range(t.start[0], t.end[0]))
    kept, at = [], 0
    for start, end in spans:  # cut, keeping the line breaks (rows stay numbered)
        if start >= at:
            kept += [text[at:start], "\n" * text.count("\n", start, end)]
            at = end
    kept.append(text[at:])
    lines = "".join(kept).split("\n")
    out = [line if row in inside else line.rstrip() for row, line in enumerate(lines, 1)]
    return "\n".join(line for row, line in enumerate(out, 1) if line or row in inside)


def _lines(text: str) -> list[str]:
    """``text``'s lines, each with its ``\\n``, as tokenize and ast number them."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def _line_starts(lines: list[str]) -> list[int]:
    starts, at = [0], 0
    for line in lines:
        at += len(line)
        starts.append(at)
    return starts


def _docstring_spans(text: str, lines: list[str], starts: list[int]) -> list[tuple[int, int]]:
    """Character offsets of the docstrings of ``text`` (its ``lines``, starting at ``starts``): its
    module's, classes' and functions' (the ast's columns count UTF-8 bytes: turned into characters
    line by line)."""

    def offset(row: int, byte_col: int) -> int:
        return starts[row - 1] + len(lines[row - 1].encode("utf-8")[:byte_col].decode("utf-8"))

    spans = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                spans.append((offset(first.lineno, first.col_offset), offset(first.end_lineno, first.end_col_offset)))
    return spans


def stamp_lines(paths: list[str | Path], cache_file: str | None = None, base: str | Path | None = None) -> list[str]:
    """``digest  path`` of every file in ``paths`` (:func:`code_digest`), a directory standing for
    every file under it (walked in sorted order); the paths as given, so the stamp reads like the
    rule's inputs, but relative to ``base`` (the workflow's directory) for a file inside it, so the
    same code gives the same stamp from any working directory (``snakemake --directory``)."""
    root = Path(base).resolve() if base is not None else None
    lines = []
    for given in paths:
        path = Path(given)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            lines.append(f"{code_digest(f, cache_file)}  {_label(f if f == path else Path(given) / f.relative_to(path), root)}")
    return lines


def _label(path: Path, root: Path | None) -> str:
    if root is not None:
        try:
            return str(path.resolve().relative_to(root))
        except ValueError:
            pass
    return str(path)


def stamp_settings(path: str | Path) -> Any:
    """The ``settings`` a stamp was written with (:func:`write_stamp`); None when it has none."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("settings "):
            return json.loads(line[len("settings "):])
    return None


def stamp_file(paths: list[str | Path], directory: str | Path, name: str, settings: Any = None,
               built: list[str] = (), cache_file: str | None = None, base: str | Path | None = None) -> Path:
    """The stamp of ``paths`` (:func:`write_stamp`) as ``directory/{name}.{digest16}.sha256``, written
    unless it exists, and the newest of ``name``'s stamps (a stamp current again after another is
    touched: outputs made with the other are then older than it, even for a Snakemake that reruns on
    times alone). Stamps of another content are left: a run still going may declare one (they are a
    few KB each; remove ``results/_code`` between runs to drop them). ``base``: :func:`stamp_lines`'."""
    directory = Path(directory)
    lines = _stamp_lines(paths, settings, built, cache_file, base)
    digest = sha256_text("\n".join(lines))
    out = directory / f"{name}.{digest[:16]}.sha256"
    _write_lines(lines, digest, out)
    try:
        mine = out.stat().st_mtime_ns
        if any(p != out and re.fullmatch(r"[0-9a-f]{16}", p.name[len(name) + 1:-7]) and p.stat().st_mtime_ns >= mine
               for p in directory.glob(f"{name}.*.sha256")):
            os.utime(out)
    except OSError:
        pass  # another process removed one
    return out


def write_stamp(paths: list[str | Path], out: str | Path, settings: Any = None, built: list[str] = (),
                cache_file: str | None = None) -> str:
    """Write the stamp of ``paths`` (:func:`stamp_lines`; then a ``built  path`` line for each of
    ``built``, files a job makes, named only: the jobs that read them declare them; ``settings`` as one
    line of sorted JSON when given; then the sha256 of those lines) to ``out`` atomically, unless
    ``out`` holds exactly that already (it then keeps its mtime); return that digest. ``cache_file``:
    :func:`code_digest`'s."""
    lines = _stamp_lines(paths, settings, built, cache_file)
    digest = sha256_text("\n".join(lines))
    _write_lines(lines, digest, Path(out))
    return digest


def _stamp_lines(paths: list[str | Path], settings: Any, built: list[str], cache_file: str | None,
                 base: str | Path | None = None) -> list[str]:
    lines = stamp_lines(paths, cache_file, base) + [f"built  {path}" for path in built]
    _save_cache(cache_file)
    if settings is not None:
        lines.append(f"settings {json.dumps(settings, sort_keys=True, ensure_ascii=False)}")
    return lines


def _write_lines(lines: list[str], digest: str, out: Path) -> None:
    """Write a stamp's ``lines`` and ``digest`` to ``out`` atomically unless it holds exactly them."""
    text = "".join(f"{line}\n" for line in lines) + f"{digest}  (all)\n"
    try:
        if out.read_text(encoding="utf-8") == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)


def _stamped_modules(stamp: Path, into: dict[str, str]) -> None:
    """The module digests a stamp records (dotted name -> digest), following the code stamps a stage
    stamp lists."""
    for line in stamp.read_text(encoding="utf-8").splitlines()[:-1]:
        digest, sep, path = line.partition("  ")
        if not sep or digest in ("built", "settings"):
            continue
        parts = Path(path).parts
        if path.endswith(".sha256"):
            _stamped_modules(Path(path), into)
        elif path.endswith(".py") and PACKAGE in parts:
            at = len(parts) - 1 - parts[::-1].index(PACKAGE)
            dotted = [*parts[at:-1], Path(parts[-1]).stem]
            into[".".join(dotted[:-1] if dotted[-1] == "__init__" else dotted)] = digest


_VERIFIED: set[str] = set()  # project modules this process has checked against its stamps


#: the stamps of the job a process was spawned by (judging workers, readers, SGLang's ranks)
JOB_STAMPS_ENV = "EAGLEDATA_JOB_STAMPS"


def verify_inherited_code(cache_file: str | None = DIGESTS_CACHE) -> None:
    """In a process a job spawned: :func:`verify_loaded_code` against the job's stamps (the job's first
    check with ``children`` put them in its environment); nothing elsewhere. Spawned processes import
    the code on disk when they start, which the job's own check cannot see."""
    given = os.environ.get(JOB_STAMPS_ENV)
    if given:
        verify_loaded_code(json.loads(given), cache_file)


def verify_loaded_code(stamps: list[str | Path], cache_file: str | None = DIGESTS_CACHE,
                       checked: set[str] | None = None, children: bool = False) -> None:
    """Raise :class:`CodeChangedError` unless every project module this process has loaded since the
    last call is, by its code (:func:`code_digest` of its file now), the module the ``stamps`` a job
    declared record. A job calls it once its imports are done (its modules' files are then the code it
    runs) and again at its end (modules imported since), before it publishes anything the stamps key.
    A job started after its stamps were written runs the code on disk then: an edit in between
    (reverted before the next run) would leave its results recorded as the stamps' code's, and an
    installed package that is not the stamped checkout would run unstamped code. An edit made while
    the job runs is no concern of it: its stamps name the code it loaded, the next run's stamps the
    new code. ``checked``: the modules checked already (default: this process's). ``children``: the
    processes this one spawns check themselves against the same stamps (:func:`verify_inherited_code`)."""
    if children:
        os.environ[JOB_STAMPS_ENV] = json.dumps([str(s) for s in stamps])
    stamped: dict[str, str] = {}
    for stamp in stamps:
        _stamped_modules(Path(stamp), stamped)
    seen = _VERIFIED if checked is None else checked
    changed = []
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == PACKAGE or name.startswith(PACKAGE + ".")) and path and path.endswith(".py") and name not in seen:
            seen.add(name)
            want = stamped.get(name)
            if want is None:
                changed.append(f"{name} ({path}: in no stamp)")
            elif code_digest(path, cache_file) != want:
                changed.append(f"{name} ({path})")
    if changed:
        raise CodeChangedError(
            f"this job ran code other than its stamps {[str(s) for s in stamps]} record: {', '.join(changed)}; "
            "edited while the workflow ran, or an installed eagledata that is not this checkout "
            "(pip install -e .): its results are discarded; start snakemake again")
