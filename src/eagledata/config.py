"""Configuration: schema validation with defaults, and resolved per-dataset settings.

The same schema (``config/schema.yaml``, also shipped in the package) is applied by the Snakefile
(``validate(config, schema)``) and by :func:`load_config` for library and CLI use, so both see the
same defaults. :func:`dataset_settings` merges a dataset's ``generation`` block over the global one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from .families import ModelFamily, get_family


class ConfigError(ValueError):
    pass


def schema() -> dict:
    text = resources.files("eagledata").joinpath("data/schema.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _fill_defaults(node: Any, sch: Mapping[str, Any]) -> Any:
    if not isinstance(node, dict):
        return node
    for key, sub in (sch.get("properties") or {}).items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if key in node:
            _fill_defaults(node[key], sub)
    addl = sch.get("additionalProperties")
    if isinstance(addl, dict):
        for key, value in node.items():
            if key not in (sch.get("properties") or {}):
                _fill_defaults(value, addl)
    return node


def validate_config(config: dict, source: str = "config") -> dict:
    """Validate against the schema, fill every default, and check cross references.
    Raises :class:`ConfigError` naming the key path."""
    import jsonschema

    sch = schema()
    validator = jsonschema.Draft202012Validator(sch)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.path) or "(top level)"
        raise ConfigError(f"{source}: {where}: {e.message}")
    config = _fill_defaults(config, sch)
    for name, ds in config["datasets"].items():
        if ds["model"] not in config["models"]:
            raise ConfigError(f"{source}: datasets.{name}.model: unknown model {ds['model']!r}; "
                              f"defined: {sorted(config['models'])}")
    for name, m in config["models"].items():
        try:
            get_family(m["family"], config.get("families"))
        except KeyError as exc:
            raise ConfigError(f"{source}: models.{name}.family: {exc.args[0]}") from None
    return config


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


def load_model_tokenizer(config: Mapping[str, Any], model_name: str):
    """Load (and self-check) the tokenizer of ``models.<model_name>``."""
    from .tokenizer import load_tokenizer

    m = config["models"][model_name]
    family = get_family(m["family"], config.get("families"))
    return load_tokenizer(m["tokenizer"], family, kind=m.get("tokenizer_kind", "auto"),
                          trust_remote_code=m.get("trust_remote_code", False),
                          chat_template=m.get("chat_template"))
