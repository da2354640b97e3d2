"""Snakemake entry for checkpoint `extract_plan` (plumbing only; logic in eagledata.extract.plan): the
stable shard keys of the finished tokens stage and their content-named token shards."""
import logging
import sys

from eagledata.codeinputs import verify_loaded_code
from eagledata.extract.plan import write_plan

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    verify_loaded_code(sm.input.code)  # the code imported is the code stamped (and again at the end)
    plan = write_plan(sm.input.tokens, sm.output.plan)
    logging.info("%s: %d shards to extract (one job each)", plan["dataset"], len(plan["shards"]))
    verify_loaded_code(sm.input.code)
except Exception:
    logging.exception("extract_plan failed")
    sys.exit(1)
