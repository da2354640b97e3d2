"""Snakemake entry for checkpoint `token_plan` (plumbing only; logic in eagledata.tokens.plan). The body runs
only as the main module: the processes that read a large responses file (spawned) import this file again."""
import logging
import sys

from eagledata.codeinputs import verify_loaded_code
from eagledata.tokens.memory import peak_memory_mb
from eagledata.tokens.plan import plan_shards

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 - injected by Snakemake
    logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        verify_loaded_code(sm.input.code, children=True)  # the code imported is the code stamped (and again at the end)
        plan = plan_shards(sm.input.responses, sm.output.plan, sm.params.slices, sm.wildcards.dataset,
                           sm.params.shard_size, workers=sm.threads)
        logging.info("%s: %d samples in %d shards; %d slices (re)written, the others left untouched",
                     plan["dataset"], plan["rows"], len(plan["shards"]), plan["slices_written"])
        logging.info("peak memory %.0f MB", peak_memory_mb())
        verify_loaded_code(sm.input.code)
    except Exception:
        logging.exception("token_plan failed")
        sys.exit(1)
