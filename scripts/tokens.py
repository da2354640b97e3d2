"""Snakemake entry for rule `tokens` (plumbing only; logic in eagledata.tokens.pershard). The body runs
only as the main module: the judging workers (spawned processes) import this file again."""
import logging
import sys
from pathlib import Path

from eagledata.tokens.memory import peak_memory_mb, return_freed_pages_at_once

return_freed_pages_at_once()  # before polars is imported: this job holds one shard after another

from eagledata.codeinputs import verify_loaded_code
from eagledata.config import dataset_settings, load_model_tokenizer
from eagledata.tokens.pershard import learn_and_judge

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 - injected by Snakemake
    logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        verify_loaded_code([*sm.input.code, sm.input.stamp], children=True)  # the code imported is the code stamped
        ds = dataset_settings(sm.config, sm.wildcards.dataset)
        tokenizer = load_model_tokenizer(sm.config, ds.model_name)
        m = learn_and_judge(sm.params.plan, Path(sm.params.plan).parent, sm.output[0], sm.params.store, tokenizer,
                            ds.family, policy=sm.params.policy, workers=sm.threads)
        logging.info("%s: %d samples in %d shards, tokenizer %s", ds.name, m["rows"], len(m["shards"]),
                     m["tokenizer_fingerprint"][:16])
        logging.info("provider conventions: %s", m["conventions"])
        logging.info("peak memory %.0f MB (this process; each judging worker holds one shard)", peak_memory_mb())
        verify_loaded_code([*sm.input.code, sm.input.stamp])
    except Exception:
        logging.exception("tokens failed")
        sys.exit(1)
