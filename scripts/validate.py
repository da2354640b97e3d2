"""Snakemake entry for rule `validate` (plumbing only; logic in eagledata.validate)."""
import logging
import sys

from eagledata.validate import ValidationFailed, render_summary, write_validation

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    report = write_validation(sm.input.tokens, sm.output.json, sm.output.summary, sm.params.max_bad_fraction)
    logging.info("\n%s", render_summary(report))
except ValidationFailed as exc:
    # Snakemake deletes outputs of a failed job; the log keeps the readable summary.
    with open(sm.output.summary, encoding="utf-8") as fh:
        logging.error("%s\n%s", exc, fh.read())
    print(f"eagledata: {exc}", file=sys.stderr)
    sys.exit(1)
except Exception:
    logging.exception("validate failed")
    sys.exit(1)
