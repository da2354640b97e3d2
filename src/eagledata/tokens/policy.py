"""Admission policies: which samples enter training and extraction, from both verdicts.

Every sample has a completion verdict (``exact`` | ``repaired`` | ``mismatch`` | ``error``) and a
prompt verdict (``exact`` | ``unproven`` | ``differs`` | ``unbilled`` | ``error``), see
:mod:`eagledata.tokens.checks`. A policy names the admitted values of each. Presets
(``validation.policy`` in the config):

* ``default``: completion exact or repaired, whatever the provider's prompt rendering was. The
  completion is what the drafter is trained on; our prompt ids are always the canonical rendering of
  the request, so a provider that rendered it differently (``differs``), or may have (``unproven``:
  the tools' key order, which the count cannot see), is reported, not a reason to drop a proven
  completion. A prompt that could not be rendered is never admitted.
* ``strict``: exact on both sides.
* ``exact`` / ``exact+repaired``: completion exact (or repaired) and the prompt not shown to differ
  (exact, or unbilled when the provider reports no prompt count). An ``unproven`` prompt is not
  admitted: a known other rendering (the request's key order) has its count, as a ``differs`` one
  is not.
* ``all``: everything but errors (for inspection, never for training on real data).

A mapping ``{completion: [...], prompt: [...]}`` gives the sets directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from eagledata.errors import InputError
from eagledata.tokens.checks import PROMPT_VERDICTS, VERDICTS

_PROVEN = ("exact", "repaired")
_PROMPT_RENDERED = ("exact", "unproven", "differs", "unbilled")


class PolicyError(InputError):  # an InputError, so still a ValueError
    pass


@dataclass(frozen=True)
class Policy:
    name: str
    completion: frozenset[str]
    prompt: frozenset[str]

    def admits(self, completion_verdict: str, prompt_verdict: str) -> bool:
        return completion_verdict in self.completion and prompt_verdict in self.prompt

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "completion": sorted(self.completion), "prompt": sorted(self.prompt)}


PRESETS: Mapping[str, Policy] = {p.name: p for p in (
    Policy("default", frozenset(_PROVEN), frozenset(_PROMPT_RENDERED)),
    Policy("strict", frozenset({"exact"}), frozenset({"exact"})),
    Policy("exact", frozenset({"exact"}), frozenset({"exact", "unbilled"})),
    Policy("exact+repaired", frozenset(_PROVEN), frozenset({"exact", "unbilled"})),
    Policy("all", frozenset({"exact", "repaired", "mismatch"}), frozenset(PROMPT_VERDICTS)),
)}


def resolve_policy(spec: str | Mapping[str, Any] | Policy | None) -> Policy:
    """A preset by name, a ``{completion, prompt}`` mapping, or a :class:`Policy` as is."""
    if isinstance(spec, Policy):
        return spec
    if spec is None:
        return PRESETS["default"]
    if isinstance(spec, str):
        try:
            return PRESETS[spec]
        except KeyError:
            raise PolicyError(f"unknown policy {spec!r}; presets: {sorted(PRESETS)}, or "
                              "{completion: [...], prompt: [...]}") from None
    return _custom(spec)


def _custom(spec: Mapping[str, Any]) -> Policy:
    unknown = set(spec) - {"completion", "prompt"}
    if unknown:
        raise PolicyError(f"policy: unknown key(s) {sorted(unknown)}; known: completion, prompt")
    completion = frozenset(spec.get("completion", _PROVEN))
    prompt = frozenset(spec.get("prompt", _PROMPT_RENDERED))
    for side, values, allowed in (("completion", completion, VERDICTS), ("prompt", prompt, PROMPT_VERDICTS)):
        bad = values - set(allowed)
        if bad:
            raise PolicyError(f"policy: {side}: unknown verdict(s) {sorted(bad)}; known: {list(allowed)}")
    if "error" in completion:
        raise PolicyError("policy: completion: 'error' samples have no ids to train on")
    name = f"completion={','.join(sorted(completion))};prompt={','.join(sorted(prompt))}"
    return Policy(name, completion, prompt)


def validation_setting(config: Mapping[str, Any], dataset: str, key: str) -> Any:
    """``validation.<key>`` for ``dataset``: its own ``datasets.<name>.validation`` block first, then
    the run-wide ``validation`` block."""
    own = config["datasets"][dataset].get("validation") or {}
    return own.get(key, config["validation"][key])
