"""One response record -> one tokenized training sample (prompt ids + reconstructed completion ids).

A response record is one line of a dataset's ``responses.jsonl`` (or of an imported recording):
``request`` (the exact body sent), ``status`` and ``response_raw`` (the exact body received), plus
an ``id``. :func:`tokenize_record` never raises on provider misbehaviour: the problems are carried
in the sample (``parsed.error``, ``reconstruction.flags``) for :mod:`eagledata.tokens.checks` to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from eagledata.text.chat import ChatTemplateError, prompt_ids, request_thinking, sorts_tool_keys, tool_declaration_of
from eagledata.text.families import ModelFamily
from eagledata.tokens.reconstruct import Reconstruction, count_tool_calls, reconstruct_completion, segment_ids
from eagledata.tokens.responses import ParsedResponse, ResponseError, parse_response, prompt_echo
from eagledata.text.tokenizer import Tokenizer
from eagledata.text.tool_declaration import in_deep_sorted_order

#: The alternative rendering with the tools declared in the request's own key order (see
#: :func:`alternative_prompt_lengths`).
UNSORTED_TOOLS = "unsorted_tools"


@dataclass
class Sample:
    id: str
    request: Mapping[str, Any]
    parsed: ParsedResponse
    prompt_ids: list[int]
    completion: Reconstruction
    thinking_requested: bool | None
    prompt_error: str | None = None
    #: the prompt ids are the serving engine's own (not our rendering): nothing to prove
    prompt_from_engine: bool = False

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion.ids


def parse_record(record: Mapping[str, Any]) -> ParsedResponse:
    """The record's ``response_raw`` parsed under its ``status`` (:func:`parse_response`); a record
    without a body text is a malformed response."""
    raw = record.get("response_raw")
    if not isinstance(raw, str):
        return ParsedResponse(streamed=False, error=ResponseError("malformed", "record has no response_raw text", "malformed"))
    return parse_response(raw, int(record.get("status") or 0))


def tokenize_record(
    record: Mapping[str, Any],
    tokenizer: Tokenizer,
    family: ModelFamily,
    sample_id: str,
    template: str | None = None,
    parsed: ParsedResponse | None = None,
) -> Sample:
    """Prompt ids from the chat template, completion ids from the exact response body (``parsed``:
    that body as :func:`parse_record` parsed it, when the caller did already). A record of SGLang's
    native ``/generate`` (its ``request`` holds ``input_ids``, no ``messages``) is read through its
    ``chat_request``: the messages, tools and thinking setting its ``input_ids`` were rendered from."""
    sent = record.get("request") or {}
    request = chat_form(record)
    if parsed is None:
        parsed = parse_record(record)
    messages = request.get("messages") or []
    thinking = request_thinking(request)
    prompt_error = None
    try:
        p_ids = prompt_ids(tokenizer, messages, request.get("tools"), thinking=thinking, template=template)
    except (ChatTemplateError, TypeError, KeyError, AttributeError) as exc:
        p_ids, prompt_error = [], f"prompt could not be rendered: {exc}"
    completion = reconstruct_completion(parsed, tokenizer, family, count_tool_calls(messages), thinking)
    truth = record.get("token_ids")
    from_engine = False
    if isinstance(truth, list) and parsed.error is None:
        server_prompt = record.get("prompt_token_ids") or sent.get("input_ids")
        # ids stored before eagledata cut the prompt's end some SGLang releases put before them
        echo = prompt_echo(truth, server_prompt, parsed.completion_tokens)
        completion = _ground_truth(truth[echo:] if echo else truth, completion, tokenizer, family)
        if echo:
            completion.flags.append("engine_prompt_echo")
        if isinstance(server_prompt, list):
            if server_prompt != p_ids:
                completion.flags.append("prompt_path_differs")
            p_ids, prompt_error, from_engine = list(server_prompt), None, True
        if parsed.provider is None:
            parsed.provider = str(record.get("backend") or "sglang")
    return Sample(sample_id, request, parsed, p_ids, completion, thinking, prompt_error, from_engine)


def chat_form(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """The record's request in chat form: its ``request``, or for a native SGLang ``/generate`` body
    (``input_ids``, no ``messages``) the ``chat_request`` it was built from, when the record has one."""
    request = record.get("request") or {}
    chat = record.get("chat_request")
    if "messages" not in request and "input_ids" in request and isinstance(chat, Mapping):
        return chat
    return request


def alternative_prompt_lengths(sample: Sample, tokenizer: Tokenizer, template: str | None = None,
                               json_tools: bool = True) -> dict[str, int]:
    """Our prompt length under renderings other than the canonical one that providers are known to
    use, for a request with tools: ``json_tools`` (the tools declared as JSON, for a family whose own
    declaration is not JSON; skipped with ``json_tools=False``) and ``unsorted_tools`` (the tools in
    the request's own key order, for a family whose model code deep-sorts them; present only when
    that rendering's ids differ from the canonical ones: where it is absent, the order does not
    matter). Measurements for learning a provider's variant and for telling whether the billed count
    can prove the key order; they never replace the canonical prompt ids. A prompt the serving engine
    returned itself (:attr:`Sample.prompt_from_engine`) has nothing to measure."""
    request = sample.request
    tools = request.get("tools")
    declaration = tool_declaration_of(tokenizer)
    if not tools or declaration == "json" or sample.prompt_from_engine or sample.prompt_error:
        return {}
    messages, out = request.get("messages") or [], {}
    renderings = [("json_tools", {"tool_declaration": "json"})] if json_tools else []
    if sorts_tool_keys(declaration) and not in_deep_sorted_order(tools):
        renderings.append((UNSORTED_TOOLS, {"sort_tool_keys": False}))
    for name, how in renderings:
        try:
            ids = prompt_ids(tokenizer, messages, tools, thinking=sample.thinking_requested, template=template, **how)
        except (ChatTemplateError, TypeError, KeyError, AttributeError):
            continue
        if name != UNSORTED_TOOLS or ids != sample.prompt_ids:
            out[name] = len(ids)
    return out


def _ground_truth(ids: list[int], text_path: Reconstruction, tokenizer: Tokenizer, family: ModelFamily) -> Reconstruction:
    """Ids a local server returned are the completion; the text path is kept as a measurement:
    ``text_path_differs`` when reconstructing from the returned text would have given other ids."""
    truth = segment_ids(ids, tokenizer, family, text_path.thinking)
    truth.flags.append("ground_truth_ids")
    if text_path.ids != truth.ids:
        truth.flags.append("text_path_differs")
    return truth
