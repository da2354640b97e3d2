"""Snakemake entry for rule `validate` (plumbing only; logic in eagledata.validate.summary / eagledata.validate.profiles)."""
import json
import logging
import sys
from pathlib import Path

from eagledata.codeinputs import verify_loaded_code
from eagledata.validate.profiles import history_path, record_validation
from eagledata.validate.summary import ValidationFailed, prompt_warnings, render_summary, write_validation

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
manifest = json.loads((Path(sm.input.tokens) / "manifest.json").read_text(encoding="utf-8"))
try:
    verify_loaded_code(sm.input.code)  # the code imported is the code stamped (and again at the end)
    report = write_validation(sm.input.tokens, sm.output.json, sm.output.summary, sm.params.max_bad_fraction,
                              sm.params.bad_counts)
    record_validation(history_path(sm.config["cache_dir"]), report, manifest)
    logging.info("\n%s", render_summary(report))
    for warning in prompt_warnings(report):
        print(f"eagledata validate {report['dataset']}: {warning}", file=sys.stderr)
    verify_loaded_code(sm.input.code)
except ValidationFailed as exc:
    # Snakemake deletes outputs of a failed job; the log and the fidelity history keep the findings.
    report = json.loads(Path(sm.output.json).read_text(encoding="utf-8"))
    record_validation(history_path(sm.config["cache_dir"]), report, manifest)
    logging.error("%s\n%s", exc, render_summary(report))
    # (validation.txt is removed with the job's outputs: the summary is in the log)
    print(f"eagledata: {exc.verdict}; the summary is in {sm.log[0]}", file=sys.stderr)
    sys.exit(1)
except Exception:
    logging.exception("validate failed")
    sys.exit(1)
