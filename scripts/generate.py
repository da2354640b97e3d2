"""Snakemake entry for rule `generate` (plumbing only; logic in eagledata.generate.job)."""
import json
import sys

from eagledata.errors import EagledataError
from eagledata.generate.errors import Interrupted
from eagledata.generate.job import generate_dataset
from eagledata.logs import line_log

sm = snakemake  # noqa: F821 - injected by Snakemake
with line_log(sm.log[0]) as log:
    try:
        summary = generate_dataset(sm.config, sm.wildcards.dataset, sm.output.responses, log=log,
                                   summary_path=sm.output.summary)
        log("summary: " + json.dumps(summary))
    except Interrupted as exc:  # SIGINT/SIGTERM/job timeout: in-flight requests drained, cache consistent
        log(f"INTERRUPTED: {exc}")
        print(f"generate {sm.wildcards.dataset}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except EagledataError as exc:  # expected stops: message only (file:line:field for prompts and config)
        log(f"ERROR: {exc}")
        print(f"generate {sm.wildcards.dataset}: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        import traceback

        log(traceback.format_exc())
        raise
