"""Preflight of a generate job: what can be checked before the first paid request is checked there.

The tokens stage needs the dataset's tokenizer and chat template, extraction needs the model's weights,
and the cache must hold every answer paid for. Found only after generation, any of these wastes the
money spent on the answers; so :func:`preflight` runs in the generate job after the cache is read
(so only what will be requested is checked) and before the budget ledger is opened or anything is
sent. In order:

1. **Tokenizer found** (:func:`~eagledata.generate.tokenizers.tokenizer_problem`, cheap, also run by ``eagledata plan``): the
   ``models.NAME.tokenizer`` directory exists, is a directory, and holds tokenizer files
   (``tiktoken.model`` for ``tokenizer_kind: tiktoken``); a ``chat_template`` override exists. A
   value that is no local path but has the form of a Hugging Face hub id (``org/name``) is left to
   the loader, and a failure to load it is still reported as "not found", naming the local path
   looked at, never as a hub traceback.
2. **Tokenizer loads and passes its self-check** (:func:`checked_tokenizer`): every special token
   the family relies on decodes to its name and encodes to its id
   (:func:`eagledata.text.tokenizer.self_check`).
3. **Every prompt renders** with the model's chat template (:func:`eagledata.text.chat.prompt_text`,
   with the request's thinking setting), naming ``file:line`` and the prompt id of the first that
   does not.
4. **Extraction weights exist** when extraction is enabled and the model names ``weights``: a
   directory with ``config.json`` (what the extract stage loads). A path under
   ``{results_dir}/_assets/`` is built by the workflow itself (the demo model) and is not checked.
5. **The cache disk has room** (:func:`expected_cache_bytes`) for the answers to be requested.

Any failure raises :class:`PreflightError` (a :class:`~eagledata.generate.errors.GenerationError`, so the
entry points print the message only) naming the path and what is wrong; nothing has been sent.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from eagledata.config import DatasetSettings
from eagledata.generate.errors import GenerationError
from eagledata.generate.tokenizers import cached_model_tokenizer, shown_path, tokenizer_problem, workflow_built

#: Bytes of cache per completion token of a non-streamed answer: the completion text is about 4 bytes
#: a token, stored inside ``response_raw`` (JSON inside a JSON string: quotes and backslashes escaped
#: twice, non-ASCII as ``\\uXXXX`` up to 6 bytes a character), reasoning and content alike: 16 covers it.
BYTES_PER_TOKEN = 16
#: A streamed answer is stored as the SSE body received: one ``data: {chunk}`` event of ~300 bytes per
#: token (ids, provider, model, delta, finish fields), escaped again inside the record.
STREAM_BYTES_PER_TOKEN = 400
#: Per record: ids, timing, status, usage, url, cache key, ledger reference.
RECORD_OVERHEAD_BYTES = 2048


class PreflightError(GenerationError):
    """A check before the first paid request failed; nothing was sent."""


def _fail(dataset: str, problem: str) -> PreflightError:
    return PreflightError(f"preflight for dataset {dataset!r} failed, nothing was sent: {problem}")


def checked_tokenizer(config: Mapping[str, Any], settings: DatasetSettings) -> Any:
    """The dataset's tokenizer, found, loaded and self-checked (steps 1 and 2; remembered per
    process, see :func:`eagledata.generate.tokenizers.cached_model_tokenizer`)."""
    from eagledata.text.tokenizer import TokenizerError

    model = settings.model
    problem = tokenizer_problem(model, settings.model_name)
    if problem:
        raise _fail(settings.name, problem)
    source = str(model["tokenizer"])
    try:
        return cached_model_tokenizer(config, settings.model_name)
    except TokenizerError as exc:  # self-check failures name the token, its id and the directory
        raise _fail(settings.name, f"tokenizer {source} is unusable: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. transformers' hub errors: one line, path named
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        if not Path(source).expanduser().exists():
            raise _fail(settings.name, f"tokenizer not found: {source!r} is no local directory "
                        f"({Path(source).resolve()} does not exist) and did not load as a Hugging Face hub id "
                        f"({type(exc).__name__}: {first})") from None
        raise _fail(settings.name, f"tokenizer {source} could not be loaded ({type(exc).__name__}: {first})") from None


def render_prompts(tokenizer: Any, prompts: Iterable[Any], chat_requests: Mapping[str, Mapping[str, Any]],
                   prompts_path: str, dataset: str) -> int:
    """Render every prompt with the chat template (step 3); ``chat_requests``: prompt id -> the
    OpenAI-form request of its first sample (its ``reasoning`` selects the thinking prompt)."""
    from eagledata.text.chat import prompt_text, request_thinking

    n = 0
    for p in prompts:
        request = chat_requests.get(p.id)
        if request is None:
            continue
        try:
            prompt_text(tokenizer, p.messages, p.tools, thinking=request_thinking(request))
        except Exception as exc:  # noqa: BLE001 - ChatTemplateError, or a template's own TypeError
            raise _fail(dataset, f"{prompts_path}:{p.line}: prompt {p.id!r} cannot be rendered with the chat "
                        f"template of {tokenizer.source} ({type(exc).__name__}: {exc})") from None
        n += 1
    return n


def weights_problem(config: Mapping[str, Any], settings: DatasetSettings) -> str | None:
    """Step 4: ``None`` when extraction is off for the dataset, the weights are built by the
    workflow, or they are a directory with ``config.json``."""
    weights = settings.model.get("weights")
    if not weights or not (config.get("extraction") or {}).get("enabled", True) or workflow_built(weights, config):
        return None
    path = Path(weights).expanduser()
    where = f"models.{settings.model_name}.weights; extraction is enabled: fix the path or set extraction.enabled: false"
    if not path.exists():
        return f"extraction weights directory not found: {shown_path(path)} ({where})"
    if not (path / "config.json").is_file():
        return f"extraction weights directory {shown_path(path)} has no config.json (a local HF model dir is needed; {where})"
    return None


def expected_cache_bytes(request_bytes: Iterable[int], max_tokens: int, stream: bool) -> int:
    """Upper estimate of the cache bytes the answers to these requests take (step 5): per request,
    the request body as sent (``request_bytes``: it is stored in the record) + ``max_tokens`` x
    :data:`BYTES_PER_TOKEN` (:data:`STREAM_BYTES_PER_TOKEN` for SSE streams) +
    :data:`RECORD_OVERHEAD_BYTES`. Every answer is taken to use all of ``max_tokens``."""
    per_token = STREAM_BYTES_PER_TOKEN if stream else BYTES_PER_TOKEN
    return sum(int(n) + max_tokens * per_token + RECORD_OVERHEAD_BYTES for n in request_bytes)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_problem(cache_path: str | Path, results_path: str | Path, needed: int,
                 disk_usage: Callable[[Path], Any] | None = None) -> str | None:
    """Step 5: ``None`` when the filesystem of ``cache_path`` has ``needed`` bytes free (twice that
    when the rule output ``results_path``, a second copy of the same records, is on it too)."""
    disk_usage = disk_usage or shutil.disk_usage
    cache_fs = _existing(Path(cache_path).absolute())
    results_fs = _existing(Path(results_path).absolute())
    try:
        same = cache_fs.stat().st_dev == results_fs.stat().st_dev
        free = disk_usage(cache_fs).free
    except OSError as exc:
        return f"free space of {cache_fs} cannot be read ({exc.strerror or exc})"
    total = needed * (2 if same else 1)
    if free < total:
        also = f" (and the copy in {results_path}, on the same filesystem)" if same else ""
        return (f"not enough free space for the cache {cache_path}{also}: the answers to be requested may take up to "
                f"{total:,} bytes ({needed:,} per copy, at max_tokens), {free:,} bytes free on {cache_fs}; free space, "
                "move cache_dir, or lower generation.max_tokens")
    return None


@dataclass(frozen=True)
class PreflightResult:
    tokenizer: Any
    rendered: int
    needed_bytes: int

    def summary(self, dataset: str) -> str:
        return (f"preflight {dataset}: tokenizer {self.tokenizer.source} passed its self-check, {self.rendered} "
                f"prompt(s) render with its chat template, weights and cache space checked "
                f"(up to {self.needed_bytes:,} bytes of answers)")


def preflight(config: Mapping[str, Any], settings: DatasetSettings, prompts: Iterable[Any], items: Iterable[Any],
              cache_path: str | Path, output_path: str | Path, tokenizer: Any = None) -> PreflightResult:
    """Every check of the module docstring for the samples ``items`` (the :class:`WorkItem` s to be
    requested) of ``prompts``; ``tokenizer``: one already loaded by the job (it is checked at load)."""
    items = list(items)
    if tokenizer is None:
        tokenizer = checked_tokenizer(config, settings)
    first: dict[str, Mapping[str, Any]] = {}
    for it in items:
        first.setdefault(it.prompt_id, it.chat_request)
    rendered = render_prompts(tokenizer, prompts, first, str(settings.prompts), settings.name)
    problem = weights_problem(config, settings)
    if problem:
        raise _fail(settings.name, problem)
    g = settings.generation
    needed = expected_cache_bytes((len(it.body_json.encode("utf-8")) for it in items), int(g.get("max_tokens", 4096)),
                                  bool(g.get("stream", False)))
    problem = disk_problem(cache_path, output_path, needed)
    if problem:
        raise _fail(settings.name, problem)
    return PreflightResult(tokenizer, rendered, needed)
