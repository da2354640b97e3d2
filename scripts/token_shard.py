"""Snakemake entry for rule `token_shard` (plumbing only; logic in eagledata.tokens.pershard)."""
import logging

from eagledata.config import dataset_settings, load_model_tokenizer
from eagledata.io import quick_exit
from eagledata.tokens.pershard import peak_memory_mb, reconstruct_shard, slice_sources

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    ds = dataset_settings(sm.config, sm.wildcards.dataset)
    tokenizer = load_model_tokenizer(sm.config, ds.model_name)
    where, responses = slice_sources(sm.input.slice)
    summary = reconstruct_shard(sm.input.slice, where, responses, sm.output.part, sm.output.summary, tokenizer, ds.family)
    logging.info("%s shard %s: %d samples reconstructed", ds.name, sm.wildcards.shard, summary["rows"])
    logging.info("peak memory %.0f MB", peak_memory_mb())
except Exception:
    logging.exception("token_shard failed")
    quick_exit(1)
quick_exit(0)  # one job per shard: the interpreter's teardown would cost each about 0.15 s
