"""Configuration: schema validation with defaults, and resolved per-dataset settings.

The same schema (``config/schema.yaml``, also shipped in the package) is applied by the Snakefile
(:func:`validate_workflow_config` first, then Snakemake's ``validate(config, schema)``) and by
:func:`load_config` for library and CLI use, so both see the same defaults and the same errors.
:func:`dataset_settings` merges a dataset's ``generation`` block over the global one.

Every object of the schema is closed: an unknown key anywhere is refused with the file, the key
path and the nearest known key (``config.yaml: datasets.B3.max_tokenz: unknown key; did you mean
`max_tokens`? ...``), found among the keys allowed there, then among those one level below a
sibling or one level up. Dataset names become directory names (results, logs, cache) and target
rules, so they must match :data:`DATASET_NAME_PATTERN`. The workflow also refuses, while it is parsed,
a dataset's model whose tokenizer is no directory and no hub id (:func:`check_tokenizer_locations`).
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from eagledata.text.families import ModelFamily, get_family
from eagledata.errors import InputError


class ConfigError(InputError):
    pass


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    """The config schema, parsed once per process (read-only: validation copies its defaults); with
    libyaml's safe loader where PyYAML has it (the same values, 7 times faster: every dry run reads it)."""
    text = resources.files("eagledata").joinpath("data/schema.yaml").read_text(encoding="utf-8")
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def defaults_validator(sch: Mapping[str, Any]) -> Any:
    """A Draft 2020-12 validator that fills every ``default`` while it validates (jsonschema's own
    extension point; the same behaviour as Snakemake's ``validate(..., set_default=True)``). Errors
    are reported against the config as given: defaults are only filled into objects the schema
    accepts at that point. An ``integer`` is an int only (:func:`_strict_validator`)."""
    import jsonschema

    base = _strict_validator()
    check_properties = base.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema_):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if isinstance(sub, Mapping) and "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, properties, instance, schema_)

    return jsonschema.validators.extend(base, {"properties": properties_with_defaults})(sch)


@functools.cache
def _strict_validator() -> Any:
    """Draft 2020-12 where an ``integer`` is an int only: JSON Schema also counts 200.0 as one, which
    a request would then carry as ``200.0`` (an API refuses it). One class per process."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    integers = base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(base, type_checker=integers)


def _fitting_alternative(context: Any) -> list[Any]:
    """Of a oneOf/anyOf failure's sub-errors, those of the alternatives whose type the value has (a
    string's enum, not "is not of type 'object'"); all of them when none has."""
    branches: dict[Any, list[Any]] = {}
    for c in context:
        branches.setdefault(c.schema_path[0] if c.schema_path else None, []).append(c)
    fitting = [c for errs in branches.values() if not any(c.validator == "type" and not c.relative_path for c in errs)
               for c in errs]
    return fitting or list(context)


def _non_finite(value: Any, path: list[Any]) -> tuple[list[Any], float] | None:
    """The key path and value of the first NaN or infinity in ``value`` (YAML's .nan, .inf), else
    None: no JSON request or file can carry one."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        found = _non_finite(sub, path + [key])
        if found is not None:
            return found
    return None


#: Allowed dataset names: letters, digits, ``.``, ``_`` and ``-``, not starting with ``.``.
DATASET_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$"
DATASET_NAME_RULE = ("a dataset name may use only letters, digits, '.', '_' and '-' and may not start with '.' "
                     f"(pattern {DATASET_NAME_PATTERN}): it becomes a directory name under results/, logs/ and "
                     "the cache, and a target rule")


def _key_path(parts: Any) -> str:
    return ".".join(str(p) for p in parts)


def _resolve(sch: Any, root: Mapping[str, Any]) -> Any:
    """``sch`` with a local ``$ref`` (``#/...``) followed."""
    seen = 0
    while isinstance(sch, Mapping) and isinstance(sch.get("$ref"), str) and sch["$ref"].startswith("#/") and seen < 16:
        target: Any = root
        for part in sch["$ref"][2:].split("/"):
            target = target[part]
        sch, seen = target, seen + 1
    return sch


def _properties(sch: Any, root: Mapping[str, Any]) -> dict[str, Any]:
    """The named properties an object schema allows (through ``$ref``, ``allOf``, ``anyOf``, ``oneOf``)."""
    sch = _resolve(sch, root)
    if not isinstance(sch, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in sch.get(key) or []:
            for name, value in _properties(sub, root).items():
                out.setdefault(name, value)
    for name, value in (sch.get("properties") or {}).items():
        # the more specific definition (with a type) wins over a defaults-only entry
        if name not in out or (isinstance(value, Mapping) and set(value) - {"default", "description"}):
            out[name] = value
    return out


def _schema_at(root: Mapping[str, Any], path: list[Any]) -> Any:
    """The schema that applies at ``path`` of a config (``None`` where the schema says nothing)."""
    sch: Any = root
    for part in path:
        props = _properties(sch, root)
        if part in props:
            sch = props[part]
            continue
        addl = _resolve(sch, root).get("additionalProperties") if isinstance(_resolve(sch, root), Mapping) else None
        if isinstance(addl, Mapping):
            sch = addl
            continue
        return None
    return sch


def _suggestion(root: Mapping[str, Any], parent: list[Any], key: str) -> str:
    """A "did you mean" for unknown ``key`` under ``parent``: a key allowed there, else one a level
    below a sibling or a level up (the key written in the wrong block)."""
    here = _properties(_schema_at(root, parent), root)
    close = difflib.get_close_matches(key, list(here), n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    where: dict[str, list[Any]] = {}
    for name, sub in here.items():
        for child in _properties(sub, root):
            where.setdefault(child, parent + [name])
    if parent:
        for name in _properties(_schema_at(root, parent[:-1]), root):
            where.setdefault(name, parent[:-1])
    close = difflib.get_close_matches(key, list(where), n=1, cutoff=0.6)
    if close:
        at = where[close[0]]
        full = _key_path(at + [close[0]])
        return f"; did you mean `{close[0]}`? It belongs under `{_key_path(at) or '(top level)'}`: write `{full}`"
    return ""


def _unknown_keys(error: Any) -> list[tuple[list[Any], str, list[str]]]:
    """(parent path, unknown key, allowed keys) of every unknown key behind a schema error (also
    inside ``oneOf``/``anyOf`` branches, where the object branch is the one that names them)."""
    out: list[tuple[list[Any], str, list[str]]] = []
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = list(error.schema.get("properties") or {})
        patterns = list(error.schema.get("patternProperties") or {})
        for key in error.instance:
            if key not in allowed and not any(re.search(p, str(key)) for p in patterns):
                out.append((list(error.absolute_path), key, allowed))
    for sub in error.context or []:
        if isinstance(sub.instance, Mapping) and sub.validator == "additionalProperties":
            out.extend(_unknown_keys(sub))
    return out


def _check_dataset_names(config: Mapping[str, Any], source: str) -> None:
    datasets = config.get("datasets")
    if not isinstance(datasets, Mapping):
        return
    for name in datasets:
        if not isinstance(name, str):  # YAML reads `2024:` as a number
            raise ConfigError(f"{source}: datasets.{name}: a dataset name must be a string; quote it (\"{name}\":)")
        if not re.fullmatch(DATASET_NAME_PATTERN, name):
            raise ConfigError(f"{source}: datasets.\"{name}\": dataset name {str(name)!r} is not allowed: {DATASET_NAME_RULE}")


def validate_config(config: dict, source: str = "config") -> dict:
    """Validate against the schema, fill every default, and check cross references.

    Raises :class:`ConfigError` naming ``source`` (the file), the key path and, for an unknown
    key, the nearest known one (every unknown key is listed, one per line)."""
    import jsonschema

    if not isinstance(config, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, got {type(config).__name__}")
    _check_dataset_names(config, source)
    for name, ds in (config.get("datasets") or {}).items():
        if isinstance(ds, dict) and ("prompts" in ds) == ("responses" in ds):
            raise ConfigError(f"{source}: datasets.{name}: give exactly one of `prompts` (generate the responses) "
                              f"or `responses` (import them), {'not both' if 'prompts' in ds else 'neither is set'}")
    bad = _non_finite(config, [])
    if bad is not None:
        raise ConfigError(f"{source}: {_key_path(bad[0])}: {bad[1]} is not a number JSON can carry")
    sch = schema()
    errors = sorted(_strict_validator()(sch).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    unknown = []
    for e in errors:
        for parent, key, _allowed in _unknown_keys(e):
            line = f"{source}: {_key_path(parent + [key])}: unknown key{_suggestion(sch, parent, str(key))}"
            if line not in unknown:
                unknown.append(line)
    if unknown:
        raise ConfigError("\n".join(unknown))
    if errors:
        e = errors[0]
        # "not valid under any of the given schemas" says nothing: the alternative closest to the value does
        e = jsonschema.exceptions.best_match(_fitting_alternative(e.context)) if e.context else e
        raise ConfigError(f"{source}: {_key_path(e.absolute_path) or '(top level)'}: {e.message}")
    for e in defaults_validator(sch).iter_errors(config):  # valid as given: this pass only fills defaults
        raise ConfigError(f"{source}: {_key_path(e.absolute_path) or '(top level)'}: {e.message} (after defaults)")
    if "final_norm" in config["extraction"]:
        raise ConfigError(f"{source}: extraction.final_norm: removed ({config['extraction']['final_norm']!r}): every "
                          "extraction stores the final hidden state BEFORE the final norm with the norm's weight and "
                          "epsilon, and both exports (export.specforge: after the norm, derived; export.speculators: "
                          "before it) read one extraction; delete the key")
    for name, ds in config["datasets"].items():
        if ds["model"] not in config["models"]:
            raise ConfigError(f"{source}: datasets.{name}.model: unknown model {ds['model']!r}; "
                              f"defined: {sorted(config['models'])}")
    provider = (config.get("simulator") or {}).get("provider", "exact")
    if provider != "exact":  # (the profiles' module is heavy: only read for another profile)
        from eagledata.standin.profiles import PROFILES

        if provider not in PROFILES:
            raise ConfigError(f"{source}: simulator.provider: unknown stand-in profile {provider!r}; "
                              f"known: {', '.join(sorted(PROFILES))}")
    for name, m in config["models"].items():
        try:
            get_family(m["family"], config.get("families"))
        except KeyError as exc:
            raise ConfigError(f"{source}: models.{name}.family: {exc.args[0]}") from None
    blocks = [("generation", config.get("generation") or {})]
    blocks += [(f"datasets.{n}.generation", ds.get("generation") or {}) for n, ds in config["datasets"].items()]
    for where, block in blocks:
        for key in sorted(set(block.get("extra_body") or {}) & set(EXTRA_BODY_REFUSED)):
            raise ConfigError(f"{source}: {where}.extra_body.{key}: {EXTRA_BODY_REFUSED[key]}")
    return config


#: Request fields ``extra_body`` may not set, and why: the budget and ``eagledata plan`` reserve by
#: ``generation.max_tokens``, and the client decides streaming and usage reporting.
EXTRA_BODY_REFUSED = {
    "max_tokens": "set generation.max_tokens instead: the budget and eagledata plan reserve by it",
    "max_completion_tokens": "set generation.max_tokens instead: the budget and eagledata plan reserve by it",
    "stream": "set generation.stream instead",
    "usage": "usage reporting is always requested (the budget settles by it)",
    "n": "one completion per request (a response's choices would be read as one): set samples_per_prompt instead",
}


def config_source(configfiles: Any) -> str:
    """How to name the config in messages: its file(s), or ``config`` (given on the command line)."""
    names = [str(f) for f in (configfiles or [])]
    return ", ".join(names) if names else "config"


def validate_workflow_config(config: dict, configfiles: Any = None) -> dict:
    """The Snakefile's check, before Snakemake's own ``validate`` (whose message names neither the
    file nor the nearest key): :func:`validate_config` with the config file(s) named, then
    :func:`check_tokenizer_locations`, so a dry run, or a run before its first job, stops on them."""
    source = config_source(configfiles)
    validate_config(config, source)
    check_tokenizer_locations(config, source)
    return config


def workflow_asset(path: str, config: Mapping[str, Any]) -> bool:
    """Whether ``path``, as written, lies under ``{results_dir}/_assets/``, where rules of the workflow
    build the demo's tokenizer and model: a rule input there is Snakemake's to build, or to report
    missing. (rules/common.smk's ``_built``.)"""
    return str(path).startswith(f"{config['results_dir']}/_assets/")


def check_tokenizer_locations(config: Mapping[str, Any], source: str = "config") -> None:
    """Raise :class:`ConfigError` (naming ``source``, ``models.NAME.tokenizer``, the path and the datasets
    using it) where the tokenizer of a model some dataset uses is no directory and no hub id
    (:func:`eagledata.generate.tokenizers.tokenizer_location_problem`): the rules declare a tokenizer's
    files, not its directory, so Snakemake would plan every job and the first to load it would fail.
    Models no dataset uses, and tokenizers a rule builds (:func:`workflow_asset`), are not checked."""
    from eagledata.generate.tokenizers import tokenizer_location_problem

    users: dict[str, list[str]] = {}
    for name, ds in config["datasets"].items():
        users.setdefault(ds["model"], []).append(str(name))
    for model_name, datasets in users.items():
        model = config["models"][model_name]
        if workflow_asset(model["tokenizer"], config):
            continue
        problem = tokenizer_location_problem(model)
        if problem:
            raise ConfigError(f"{source}: models.{model_name}.tokenizer: {problem} (the model of dataset(s) "
                              f"{', '.join(datasets)}); give an existing tokenizer directory or a Hugging Face "
                              "hub id (org/name)")


def load_config(path: str | Path) -> dict:
    path = Path(path)
    with open(path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    return validate_config(config, str(path))


@dataclass(frozen=True)
class DatasetSettings:
    """Everything one dataset's stages need, resolved from the config."""

    name: str
    model_name: str
    model: Mapping[str, Any]
    family: ModelFamily
    backend: str
    prompts: str | None
    responses: str | None
    generation: Mapping[str, Any]

    @property
    def api_model(self) -> str:
        return self.model.get("api_model") or self.model_name

    @property
    def imported(self) -> bool:
        return self.responses is not None


def dataset_generation(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A dataset's ``generation`` settings: the global ones, overridden by its own."""
    ds = (config.get("datasets") or {}).get(name) or {}
    return {**(config.get("generation") or {}), **(ds.get("generation") or {})}


def dataset_settings(config: Mapping[str, Any], name: str) -> DatasetSettings:
    try:
        ds = config["datasets"][name]
    except KeyError:
        raise ConfigError(f"unknown dataset {name!r}; defined: {sorted(config['datasets'])}") from None
    model = config["models"][ds["model"]]
    generation = dataset_generation(config, name)
    return DatasetSettings(
        name=name,
        model_name=ds["model"],
        model=model,
        family=get_family(model["family"], config.get("families")),
        backend=ds.get("backend", "openrouter"),
        prompts=ds.get("prompts"),
        responses=ds.get("responses"),
        generation=generation,
    )


def tokenizer_from_settings(settings: Mapping[str, Any] | None):
    """(tokenizer, family) of a model's tokenizer settings as a stage stamp carries them
    (rules/common.smk ``tokenizer_settings``: the model's ``tokenizer``, ``tokenizer_revision``,
    ``tokenizer_kind``, ``trust_remote_code``, ``chat_template``, ``family`` and the config's
    ``family_definition``):
    what :func:`load_model_tokenizer` and :func:`dataset_settings` give for that model. ``None`` (a
    stamp without settings, written by an older eagledata) is refused: rerun its stamp job."""
    if settings is None:
        raise ConfigError("the stage stamp carries no tokenizer settings (written by an older eagledata): "
                          "start snakemake again, which writes the stamps")
    name = settings["family"]
    definition = settings.get("family_definition")
    families = {name: definition} if definition is not None else {}
    model = {k: v for k, v in settings.items() if k != "family_definition" and v is not None}
    config = {"models": {"model": model}, "families": families}
    return load_model_tokenizer(config, "model"), get_family(name, families)


def load_model_tokenizer(config: Mapping[str, Any], model_name: str):
    """Load (and self-check) the tokenizer of ``models.<model_name>``."""
    from eagledata.text.tokenizer import load_tokenizer

    m = config["models"][model_name]
    family = get_family(m["family"], config.get("families"))
    return load_tokenizer(m["tokenizer"], family, kind=m.get("tokenizer_kind", "auto"),
                          trust_remote_code=m.get("trust_remote_code", False),
                          chat_template=m.get("chat_template"), revision=m.get("tokenizer_revision"))
