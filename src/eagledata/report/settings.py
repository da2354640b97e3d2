"""The reports' settings (config key ``report``): its defaults, read from the config schema, and the
config's block over them. Apart from :mod:`eagledata.report.build` so the workflow reads them without
importing what builds reports (polars and the charts: half a second of every dry run)."""

from __future__ import annotations

from typing import Any, Mapping

from eagledata.config import schema
from eagledata.errors import InputError

#: Settings of the reports (config key ``report``; every key optional).
#: The ``report`` block's defaults, read from the config schema (one place states them).
REPORT_DEFAULTS: dict[str, Any] = {
    key: sub["default"] for key, sub in schema()["properties"]["report"]["properties"].items()}


def report_settings(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``REPORT_DEFAULTS`` overlaid with the config's ``report`` block (unknown keys are an error)."""
    own = dict((config or {}).get("report") or {})
    unknown = sorted(set(own) - set(REPORT_DEFAULTS))
    if unknown:
        raise InputError(f"config: report: unknown key(s) {unknown}; known: {sorted(REPORT_DEFAULTS)}")
    return {**REPORT_DEFAULTS, **own}
