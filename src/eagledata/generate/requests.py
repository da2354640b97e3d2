"""Request bodies and cache keys: what is sent for each sample of a prompts dataset, and the key under
which its answer is cached.

A cache key is the sha256 of the canonical JSON of the exact request body, plus the sample number for
samples after the first, plus a salt naming the endpoint when it is not OpenRouter's (and the
stand-in's identity for the simulator backend), so a rerun requests only what is missing and any
change of an output-shaping setting requests anew.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from eagledata.config import DatasetSettings, dataset_settings, load_model_tokenizer
from eagledata.generate.dedup import dataset_option, dedup_prompts
from eagledata.generate.errors import GenerationError
from eagledata.generate.prompts import Prompt, canonical, canonical_json, read_prompts
from eagledata.io import sha256_text

DEFAULT_API_BASE = "https://openrouter.ai/api/v1"
#: Generation settings that shape the responses (the rest only shape how they are fetched).
OUTPUT_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "reasoning", "provider", "stream",
                   "samples_per_prompt", "tool_choice", "parallel_tool_calls", "extra_body", "sglang_endpoint")


def uses_native_endpoint(settings: DatasetSettings) -> bool:
    """Whether the dataset is sent to SGLang's native ``/generate`` (prompt ids, not messages)."""
    return settings.backend == "sglang" and settings.generation.get("sglang_endpoint") == "generate"


def build_request(prompt: Prompt, settings: DatasetSettings, sample_index: int = 0) -> dict[str, Any]:
    """The exact OpenRouter request body for one sample. Optional settings are sent only when not
    null; with a ``seed``, sample ``k`` uses ``seed + k``; ``extra_body`` keys are added last
    (they cannot replace ``model``, ``messages`` or ``tools``)."""
    g = settings.generation
    body: dict[str, Any] = {"model": settings.api_model, "messages": prompt.messages}
    if prompt.tools:
        body["tools"] = prompt.tools
        for key in ("tool_choice", "parallel_tool_calls"):
            if g.get(key) is not None:
                body[key] = g[key]
    body["max_tokens"] = g.get("max_tokens", 4096)
    for key in ("temperature", "top_p"):
        if g.get(key) is not None:
            body[key] = g[key]
    if g.get("seed") is not None:
        body["seed"] = int(g["seed"]) + sample_index
    for key in ("reasoning", "provider"):
        if g.get(key) is not None:
            body[key] = g[key]
    body["stream"] = bool(g.get("stream", False))
    body["usage"] = {"include": True}
    for key, value in (g.get("extra_body") or {}).items():
        if key not in ("model", "messages", "tools"):
            body[key] = value
    return body


def sglang_chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenRouter body as SGLang's ``/v1/chat/completions`` body: no ``provider``/``usage``
    (OpenRouter's), never streamed, and the generated (and prompt) token ids requested. Thinking
    turned off (``reasoning.enabled: false`` or effort ``none``) is also said the way SGLang's chat
    template step reads it, ``chat_template_kwargs.thinking: false`` (unless ``extra_body`` sets it):
    SGLang takes ``reasoning.enabled`` only as a switch on, and releases before
    sgl-project/sglang#9715 read no ``reasoning`` at all, so K2.5 thought in every answer."""
    from eagledata.text.chat import request_thinking

    out = {k: v for k, v in body.items() if k not in ("provider", "usage", "stream")}
    out["stream"] = False
    out["return_token_ids"] = True
    out["return_prompt_token_ids"] = True
    if request_thinking(body) is False:
        kwargs = out.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {"thinking": False, **(kwargs if isinstance(kwargs, Mapping) else {})}
    return out


def sglang_generate_request(body: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The native ``/generate`` body: the prompt as ids from the model's chat template, the
    sampling settings in SGLang's names, special tokens kept in the text (so the text path can be
    checked against the ids)."""
    from eagledata.text.chat import prompt_ids, request_thinking

    sp: dict[str, Any] = {"max_new_tokens": body.get("max_tokens"), "skip_special_tokens": False, "no_stop_trim": True}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "sampling_seed")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    for key in ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop"):
        if body.get(key) is not None:
            sp[key] = body[key]
    ids = prompt_ids(tokenizer, body["messages"], body.get("tools"), thinking=request_thinking(body))
    return {"input_ids": ids, "sampling_params": sp, "stream": False}


def cache_key(body: Mapping[str, Any], sample_index: int = 0, salt: Mapping[str, Any] | None = None) -> str:
    """sha256 of the canonical JSON of ``body``; samples after the first and a backend ``salt``
    (the endpoint; the simulator's seed, profile and tokenizer) are appended, since they change
    the answer to an identical body."""
    text = canonical_json(body)
    extra = {k: v for k, v in (("sample", sample_index or None), ("salt", salt or None)) if v is not None}
    if extra:
        text += "\n" + canonical_json(extra)
    return sha256_text(text)


def simulator_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The stand-in settings that shape its answers (seed, provider profile)."""
    sim = dict(config.get("simulator") or {})
    return {"seed": sim.get("seed", 0), "provider": sim.get("provider", "exact")}


def normalized_api_base(settings: DatasetSettings) -> str:
    """``generation.api_base`` without a trailing slash (SGLang's: the server root, no ``/v1``)."""
    base = str(settings.generation.get("api_base") or DEFAULT_API_BASE).rstrip("/")
    if settings.backend == "sglang":
        base = base.removesuffix("/v1")
    return base


def endpoint_salt(settings: DatasetSettings) -> dict[str, Any] | None:
    """What, beyond the body, selects the model that answers: a non-default endpoint, and the model's
    ``revision`` where the config labels the weights served."""
    revision = {"revision": settings.model["revision"]} if settings.model.get("revision") else {}
    if settings.backend == "simulator":
        return None
    base = normalized_api_base(settings)
    if settings.backend == "sglang":
        return {"endpoint": base, "sglang": settings.generation.get("sglang_endpoint", "chat"), **revision}
    return {**({} if base == DEFAULT_API_BASE else {"endpoint": base}), **revision} or None


#: Host names of this machine's loopback interface: one server, however the endpoint names it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def equivalent_salts(salt: Mapping[str, Any] | None) -> list[dict[str, Any] | None]:
    """The salts of the same endpoint spelled otherwise (``salt`` itself left out): its host as another
    loopback name (``localhost``, ``127.0.0.1``, ``[::1]``), or lower-cased, and the scheme's default port
    written or left out. A sample cached under one of them is the same request to the same server
    (:class:`~eagledata.generate.respell.Respeller` takes it instead of asking again). The default
    OpenRouter base has no salt (:func:`endpoint_salt`)."""
    from urllib.parse import urlsplit

    base = (salt or {}).get("endpoint")
    if not isinstance(base, str):
        return []
    try:
        url = urlsplit(base)
        port = url.port
    except ValueError:
        return []
    host = (url.hostname or "").lower()
    if not host or url.username or url.password:
        return []
    host = f"[{host}]" if ":" in host else host
    hosts = LOOPBACK_HOSTS if host in LOOPBACK_HOSTS else (host,)
    default = _DEFAULT_PORTS.get(url.scheme.lower())
    ports = ["", f":{default}"] if default and (port is None or str(port) == default) else [f":{port}" if port else ""]
    out: list[dict[str, Any] | None] = []
    for h in hosts:
        for pt in ports:
            spelled = f"{url.scheme.lower()}://{h}{pt}{url.path}" + (f"?{url.query}" if url.query else "")
            other: dict[str, Any] | None = {**salt, "endpoint": spelled}
            if spelled == DEFAULT_API_BASE and "sglang" not in salt:  # the default base has no endpoint salt
                other = {k: v for k, v in salt.items() if k != "endpoint"} or None
            if other != salt and other not in out:
                out.append(other)
    return out


def request_params(settings: DatasetSettings, config: Mapping[str, Any]) -> dict[str, Any]:
    """The output-shaping settings of a dataset (the ``generate`` rule's ``params``): changing one
    reruns the rule, and the cache makes that rerun request only what changed. Concurrency,
    timeouts, retry and budget settings are left out on purpose."""
    params: dict[str, Any] = {"backend": settings.backend, "model": settings.api_model}
    params.update({k: settings.generation.get(k) for k in OUTPUT_SETTINGS})
    params.update({k: dataset_option(config, settings.name, k) for k in ("turns", "dedup")})
    salt = endpoint_salt(settings)
    if salt:
        params["endpoint"] = salt
    if settings.backend == "simulator":
        params["simulator"] = {**simulator_settings(config), **simulated_family(config, settings)}
        params["price_per_mtok"] = dict(settings.model.get("price_per_mtok") or {})
    if tokenizer_shapes_responses(settings):
        # its files are the rule's inputs; a hub id has none, so its name and pinned revision are here
        params["tokenizer"] = {k: settings.model.get(k) for k in TOKENIZER_IDENTITY}
    return canonical(params)  # Snakemake compares params as written out: key order must not count


#: What names a model's tokenizer beyond its files (also in rules/common.smk's tokenizer settings).
TOKENIZER_IDENTITY = ("tokenizer", "tokenizer_revision", "tokenizer_kind", "trust_remote_code")


def tokenizer_shapes_responses(settings: DatasetSettings) -> bool:
    """Whether the dataset's responses depend on its model's tokenizer: the stand-in answers with it,
    and SGLang's native endpoint is sent prompt ids from it. A paid API is sent text (its responses
    never depend on our tokenizer, so no tokenizer change re-requests one)."""
    return settings.backend == "simulator" or (settings.backend == "sglang"
                                               and settings.generation.get("sglang_endpoint") == "generate")


def simulated_family(config: Mapping[str, Any], settings: DatasetSettings) -> dict[str, Any]:
    """The model family the stand-in answers as (whether it thinks, its markup), with the config's
    definition of it: it shapes the stand-in's answers as its seed does."""
    family = settings.model.get("family")
    return {"family": family, "family_definition": (config.get("families") or {}).get(family)}


@dataclass(frozen=True)
class WorkItem:
    """One sample to request: its ids, the exact body (and its serialisation) and its cache key."""

    id: str
    prompt_id: str
    sample_index: int
    request: dict[str, Any]  # the exact body sent
    cache_key: str
    chat_request: dict[str, Any]  # the OpenAI-form request (== request for chat endpoints)
    body_json: str  # ``request`` serialised: the bytes sent, and embedded as-is in the record
    conversation: str | None = None  # ``turns: all``: the conversation (record id, ``#k`` for samples after one)
    turn: int | None = None  # ``turns: all``: the turn number (0 = the first user turn)


@dataclass
class DatasetWork:
    """A prompts dataset's work: settings, prompts, every sample's item, the endpoint. With
    ``turns: all`` the items are each conversation's first turn (the later ones are known only from
    the replies: :mod:`eagledata.generate.turns`)."""

    settings: DatasetSettings
    prompts: list[Prompt]
    items: list[WorkItem]
    salt: dict[str, Any] | None
    url: str  # the completion endpoint
    api_base: str
    turns: str = "last"  # the dataset's ``turns`` setting
    duplicates: list[Any] = field(default_factory=list)  # the records left out (:mod:`eagledata.generate.dedup`)
    tokenizer: Any = None


def sample_id(prompt_id: str, sample_index: int, samples_per_prompt: int) -> str:
    """A sample's id: the prompt's, with ``#k`` when the dataset has more than one sample per prompt."""
    return prompt_id if samples_per_prompt == 1 else f"{prompt_id}#{sample_index}"


def make_item(p: Prompt, settings: DatasetSettings, k: int, salt: Mapping[str, Any] | None, tokenizer: Any,
              turn: int | None = None) -> WorkItem:
    """One sample's item; with ``turn`` (``turns: all``), ``p.messages`` are that turn's request's
    messages and the id is ``SAMPLE#tTURN``."""
    n = int(settings.generation.get("samples_per_prompt", 1))
    chat = build_request(p, settings, k)
    if settings.backend == "sglang":
        body = sglang_generate_request(chat, tokenizer) if uses_native_endpoint(settings) else sglang_chat_request(chat)
    else:
        body = chat
    sid = sample_id(p.id, k, n)
    return WorkItem(sid if turn is None else f"{sid}#t{turn}", p.id, k, body, cache_key(body, k, salt), chat,
                    json.dumps(body, ensure_ascii=False), None if turn is None else sid, turn)


def work_items(prompts: Iterable[Prompt], settings: DatasetSettings, salt: Mapping[str, Any] | None = None,
               tokenizer: Any = None) -> list[WorkItem]:
    """Every sample of ``prompts`` in prompt-file order (``samples_per_prompt`` each; ids
    ``PROMPT#k`` when more than one), with the body the dataset's backend is sent."""
    n = int(settings.generation.get("samples_per_prompt", 1))
    return [make_item(p, settings, k, salt, tokenizer) for p in prompts for k in range(n)]


def simulator_salt(config: Mapping[str, Any], settings: DatasetSettings, tokenizer: Any) -> dict[str, Any]:
    """The stand-in's identity (settings, model family, tokenizer fingerprint, prices): it shapes its answers."""
    return {"simulator": {**simulator_settings(config), **simulated_family(config, settings),
                          "tokenizer": tokenizer.fingerprint,
                          "price_per_mtok": dict(settings.model.get("price_per_mtok") or {})}}


def dataset_work(config: Mapping[str, Any], dataset: str, tokenizer: Any = None) -> DatasetWork:
    """The work of a prompts dataset: every sample's exact request and cache key. ``tokenizer`` is
    needed for the simulator backend (its identity salts the keys) and SGLang's native endpoint."""
    s = dataset_settings(config, dataset)
    if s.imported or not s.prompts:
        raise GenerationError(f"dataset {dataset!r} has 'responses:' (imported); it is not generated")
    if s.backend not in ("openrouter", "sglang", "simulator"):
        raise GenerationError(f"dataset {dataset!r}: unknown backend {s.backend!r}")
    native = uses_native_endpoint(s)
    turns, dedup = dataset_option(config, dataset, "turns"), dataset_option(config, dataset, "dedup")
    if turns == "all" and native:
        raise GenerationError(f"dataset {dataset!r}: turns: all needs the chat endpoint (the replies are parsed into "
                              "the next turn's history); set generation.sglang_endpoint: chat")
    if tokenizer is None and (s.backend == "simulator" or native or dedup):
        tokenizer = load_model_tokenizer(config, s.model_name)
    prompts = read_prompts(s.prompts)
    duplicates: list[Any] = []
    if dedup:
        prompts, duplicates = dedup_prompts(config, dataset, prompts, tokenizer)
    salt = simulator_salt(config, s, tokenizer) if s.backend == "simulator" else endpoint_salt(s)
    base = normalized_api_base(s)
    if s.backend == "sglang":
        url = base + ("/generate" if native else "/v1/chat/completions")
    else:
        url = base + "/chat/completions"
    items = work_items(prompts, s, salt, tokenizer) if turns == "last" else first_turns(prompts, s, salt, tokenizer)
    return DatasetWork(s, prompts, items, salt, url, base, turns, duplicates, tokenizer)


def first_turns(prompts: Iterable[Prompt], settings: DatasetSettings, salt: Mapping[str, Any] | None,
                tokenizer: Any) -> list[WorkItem]:
    """``turns: all``: the first turn of every conversation (records without a user turn have none)."""
    from eagledata.generate.conversation import turn_request

    n = int(settings.generation.get("samples_per_prompt", 1))
    items = []
    for p in prompts:
        messages = turn_request(p.messages, [], settings.family)
        if isinstance(messages, list):
            items += [make_item(replace(p, messages=messages), settings, k, salt, tokenizer, turn=0) for k in range(n)]
    return items
