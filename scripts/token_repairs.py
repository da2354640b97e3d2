"""Snakemake entry for rule `token_repairs` (plumbing only; logic in eagledata.tokens.pershard)."""
import logging
import sys
from pathlib import Path

from eagledata.config import dataset_settings, load_model_tokenizer
from eagledata.tokens.pershard import learn_repairs, peak_memory_mb, plan_keys, work_paths

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    ds = dataset_settings(sm.config, sm.wildcards.dataset)
    tokenizer = load_model_tokenizer(sm.config, ds.model_name)
    parts = [work_paths(Path(sm.input.learned).parent, k)["part"] for k in plan_keys(sm.params.plan)]
    learned = learn_repairs(sm.input.learned, parts, sm.output[0], tokenizer, ds.family)
    logging.info("%s: repairs proven per provider: %s", ds.name, learned["repairs"])
    logging.info("peak memory %.0f MB", peak_memory_mb())
except Exception:
    logging.exception("token_repairs failed")
    sys.exit(1)
