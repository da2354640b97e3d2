"""Snakemake entry for rules `code_stamp` and `stage_stamp` (plumbing only; logic in eagledata.codeinputs)."""
import logging
import sys

from eagledata.codeinputs import write_stamp

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    digest = write_stamp(list(sm.input), sm.output[0], settings=dict(sm.params.items()).get("settings"))
    logging.info("%s: %d inputs, sha256 %s", sm.output[0], len(sm.input), digest)
except Exception:
    logging.exception("stamp failed")
    sys.exit(1)
