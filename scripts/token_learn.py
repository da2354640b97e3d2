"""Snakemake entry for rule `token_learn` (plumbing only; logic in eagledata.tokens.pershard)."""
import logging
import sys

from eagledata.tokens.pershard import learn_summaries, peak_memory_mb

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    learned = learn_summaries(sm.input.summaries, sm.output[0])
    logging.info("%d samples in %d shard summaries; conventions: %s", learned["rows"], len(sm.input.summaries),
                 learned["conventions"])
    logging.info("peak memory %.0f MB", peak_memory_mb())
except Exception:
    logging.exception("token_learn failed")
    sys.exit(1)
