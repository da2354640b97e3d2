"""Snakemake entry for rule `import_responses` (plumbing only; logic in eagledata.generate.imports)."""
import json
import sys

from eagledata.config import dataset_settings
from eagledata.generate.imports import import_responses
from eagledata.io import ResponsesFileError
from eagledata.logs import line_log

sm = snakemake  # noqa: F821 - injected by Snakemake
with line_log(sm.log[0]) as log:
    try:
        ds = dataset_settings(sm.config, sm.wildcards.dataset)
        summary = import_responses(sm.input[0], ds.name, sm.output[0], log=log)
        log("summary: " + json.dumps(summary))
    except ResponsesFileError as exc:
        log(f"ERROR: {exc}")
        print(f"import_responses {sm.wildcards.dataset}: {exc}", file=sys.stderr)
        sys.exit(1)
