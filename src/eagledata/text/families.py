"""Model families: the token conventions of a chat model's completions.

A :class:`ModelFamily` names the special tokens that delimit a completion (thinking block, tool-call
section, end of turn) and says whether the model thinks and whether its generation prompt already
contains the opening think token. Ids are never stored here: they are looked up by name in the
tokenizer at load time (see :mod:`eagledata.text.tokenizer`).

Kimi K2 Instruct, K2 Thinking and K2.5 are built in; other families come from configuration
(``families:`` in the config file) with the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping
from eagledata.errors import EagledataError

#: Kimi's pre-tokenization regex (tiktoken ``pat_str``), the same for K2, K2 Thinking, K2.5 and K2.6.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class UnknownFamilyError(EagledataError, KeyError):
    pass


#: Ways a family's tokenizer code declares tools to the chat template.
TOOL_DECLARATIONS = ("json", "typescript")


@dataclass(frozen=True)
class ModelFamily:
    """Token conventions of one model family.

    ``think_in_prompt``: the generation prompt ends with ``think_open`` (K2.5), so the completion
    starts with reasoning text; otherwise a thinking model's completion starts with ``think_open``.
    ``tool_call_id_format`` builds the model's native tool-call id from ``name`` and the
    conversation-wide call ``index``.
    """

    name: str
    thinking: bool
    think_in_prompt: bool = False
    think_open: str = "<think>"
    think_close: str = "</think>"
    end_of_turn: str = "<|im_end|>"
    tool_section_begin: str = "<|tool_calls_section_begin|>"
    tool_section_end: str = "<|tool_calls_section_end|>"
    tool_call_begin: str = "<|tool_call_begin|>"
    tool_argument_begin: str = "<|tool_call_argument_begin|>"
    tool_call_end: str = "<|tool_call_end|>"
    tool_call_id_format: str = "functions.{name}:{index}"
    tool_call_id_pattern: str = r"functions\.(?P<name>.+):(?P<index>\d+)"
    #: Role markers the chat template uses; checked at tokenizer load like the others.
    role_tokens: tuple[str, ...] = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")
    #: Pre-tokenization regex used when a tokenizer directory ships none (published Kimi model dirs).
    pattern: str = KIMI_PATTERN
    #: Number of special ids above the BPE ranks (reserved ones get ``<|reserved_token_N|>`` names).
    special_range: int = 256
    #: How the model's own tokenizer code declares a request's tools to the chat template:
    #: ``json`` (the template serialises ``tools`` itself) or ``typescript`` (K2.5 / K2 Thinking:
    #: tools deep-sorted by key, then passed as ``tools_ts_str``, see :mod:`eagledata.text.tool_declaration`).
    tool_declaration: str = "json"

    def __post_init__(self) -> None:
        if self.tool_declaration not in TOOL_DECLARATIONS:
            raise UnknownFamilyError(f"family {self.name!r}: tool_declaration must be one of {list(TOOL_DECLARATIONS)}, "
                                     f"got {self.tool_declaration!r}")

    def completion_specials(self) -> tuple[str, ...]:
        """Names of every special token a completion of this family may contain."""
        names = [self.end_of_turn, self.tool_section_begin, self.tool_section_end,
                 self.tool_call_begin, self.tool_argument_begin, self.tool_call_end]
        if self.thinking:
            names = [self.think_open, self.think_close] + names
        return tuple(names)

    def required_specials(self) -> tuple[str, ...]:
        """Every special token name the pipeline relies on for this family (self-check list)."""
        return self.completion_specials() + tuple(self.role_tokens)

    def native_tool_call_id(self, name: str, index: int) -> str:
        return self.tool_call_id_format.format(name=name, index=index)


_KIMI_K2 = ModelFamily(name="kimi-k2", thinking=False)
_KIMI_K2_THINKING = ModelFamily(name="kimi-k2-thinking", thinking=True, think_in_prompt=False,
                                tool_declaration="typescript")
_KIMI_K25 = ModelFamily(name="kimi-k2.5", thinking=True, think_in_prompt=True, tool_declaration="typescript")

BUILTIN_FAMILIES: dict[str, ModelFamily] = {
    "kimi-k2": _KIMI_K2,
    "kimi-k2-instruct": replace(_KIMI_K2, name="kimi-k2-instruct"),
    "kimi-k2-thinking": _KIMI_K2_THINKING,
    "kimi-k2.5": _KIMI_K25,
    "kimi-k2.6": replace(_KIMI_K25, name="kimi-k2.6"),
}


def get_family(name: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> ModelFamily:
    """Return the family ``name``: a config-defined family (``overrides[name]``, optionally with
    ``base: <builtin>``) or a built-in one."""
    overrides = overrides or {}
    if name in overrides:
        spec = dict(overrides[name])
        base_name = spec.pop("base", None)
        base = BUILTIN_FAMILIES[base_name] if base_name else ModelFamily(name=name, thinking=False)
        known = {f.name for f in fields(ModelFamily)}
        unknown = set(spec) - known
        if unknown:
            raise UnknownFamilyError(f"family {name!r}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        if "role_tokens" in spec:
            spec["role_tokens"] = tuple(spec["role_tokens"])
        return replace(base, name=name, **spec)
    try:
        return BUILTIN_FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; built in: {sorted(BUILTIN_FAMILIES)} "
            "(define others under 'families:' in the config)"
        ) from None
