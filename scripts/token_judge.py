"""Snakemake entry for rule `token_judge` (plumbing only; logic in eagledata.tokens.pershard)."""
import logging
import sys

from eagledata.config import dataset_settings, load_model_tokenizer
from eagledata.tokens.pershard import judge_shard, peak_memory_mb
from eagledata.tokens.policy import validation_setting

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    ds = dataset_settings(sm.config, sm.wildcards.dataset)
    tokenizer = load_model_tokenizer(sm.config, ds.model_name)
    entry = judge_shard(sm.input.part, sm.input.conventions, sm.params.store, sm.output[0], tokenizer, ds.family,
                        policy=validation_setting(sm.config, ds.name, "policy"))
    logging.info("%s shard %s: %d rows -> %s (%s)", ds.name, sm.wildcards.shard, entry["rows"], entry["file"],
                 "unchanged, left untouched" if entry["kept"] else "written")
    logging.info("peak memory %.0f MB", peak_memory_mb())
except Exception:
    logging.exception("token_judge failed")
    sys.exit(1)
