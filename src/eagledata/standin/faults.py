"""Injected failures of the stand-in (:class:`Fault`, parsed from ``"429:2"``, ``"mid-stream"``, ...)
and the error bodies it answers with, in OpenRouter's and SGLang's shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

FAULT_KINDS = ("error_in_200", "mid_stream", "hang", "disconnect", "reset", "malformed", "no_usage", "abort")


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    ``kind``: ``http`` (``status`` with an OpenRouter error body, ``Retry-After: retry_after`` when
    set), ``error_in_200`` (an error object in a 200 JSON body, or an error chunk for a stream),
    ``mid_stream`` (a stream that stops with an error chunk, ``finish_reason: "error"``; a JSON
    request gets ``error_in_200``), ``hang`` (answer after ``seconds``: a client timeout),
    ``disconnect`` (close the connection without an answer), ``reset`` (abort it with a TCP RST),
    ``malformed`` (a 200 whose JSON body, or one stream chunk, is cut short), ``no_usage`` (a whole,
    billed answer that reports no cost nor counts: a JSON body without ``usage``, a stream cut after
    its finish chunk, before its usage chunk and ``[DONE]``), ``abort`` (SGLang: a 200 whose
    generation the server aborted part-way, finish ``abort``; OpenRouter: ``error_in_200``).
    """

    kind: str
    status: int = 0
    retry_after: float | None = None
    seconds: float = 0.0
    message: str = ""
    raw: str = ""  # the upstream provider's own error text (OpenRouter's ``error.metadata.raw``)

    @classmethod
    def http(cls, status: int, retry_after: float | None = None, message: str = "", raw: str = "") -> "Fault":
        return cls("http", status, retry_after, 0.0, message, raw)

    @classmethod
    def parse(cls, spec: "str | Fault") -> "Fault":
        """``"429"``, ``"429:2"`` (Retry-After 2 s), ``"502"``, ``"503"``, ``"error-in-200"``,
        ``"mid-stream"``, ``"hang:5"``, ``"disconnect"``, ``"reset"``, ``"malformed"``, ``"no-usage"``,
        ``"abort"``."""
        if isinstance(spec, Fault):
            return spec
        name, _, arg = str(spec).partition(":")
        if name.isdigit():
            status = int(name)
            retry = float(arg) if arg else (0.0 if status in (429, 503) else None)
            return cls.http(status, retry)
        kind = name.replace("-", "_")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {spec!r}; known: HTTP status codes, {', '.join(FAULT_KINDS)}")
        return cls(kind, seconds=float(arg) if arg else 0.0)


FaultPlan = Mapping[int, "Fault | str"] | Callable[[int, Mapping[str, Any]], "Fault | str | None"] | None

#: The error message OpenRouter sends with each HTTP status.
ERROR_MESSAGES = {400: "Bad request", 401: "No auth credentials found", 402: "Insufficient credits",
                   403: "Input was flagged by moderation", 408: "Request timed out", 429: "Rate limit exceeded",
                   500: "Internal server error", 502: "Provider returned error", 503: "No available provider",
                   524: "Provider timed out", 529: "Provider overloaded"}
#: HTTP reason phrases of the statuses the stand-in sends.
HTTP_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
            404: "Not Found", 408: "Request Timeout", 429: "Too Many Requests", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable", 524: "A Timeout Occurred", 529: "Site Overloaded"}


def error_body(code: int | str, message: str, provider: str = "Simulator", raw: str = "") -> dict[str, Any]:
    """OpenRouter's error object (``raw``: an upstream provider's own error text, in ``metadata.raw``)."""
    metadata = {"raw": raw, "provider_name": provider} if raw else {"provider_name": provider}
    return {"error": {"code": code, "message": message, "metadata": metadata}}


def sglang_error_body(code: int, message: str) -> dict[str, Any]:
    """SGLang's (OpenAI-compatible) error object."""
    return {"object": "error", "message": message, "type": "BadRequestError" if code < 500 else "InternalServerError",
            "param": None, "code": code}
