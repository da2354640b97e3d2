"""Snakemake entry for rule `tokens` (plumbing only; logic in eagledata.tokens.shards)."""
import logging
import sys

from eagledata.config import dataset_settings, load_model_tokenizer
from eagledata.tokens.shards import build_token_shards

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    ds = dataset_settings(sm.config, sm.wildcards.dataset)
    tokenizer = load_model_tokenizer(sm.config, ds.model_name)
    result = build_token_shards(sm.input.responses, sm.output[0], tokenizer, ds.family, ds.name,
                                shard_size=sm.params.shard_size, policy=sm.params.policy, store_dir=sm.params.store)
    m = result.manifest
    logging.info("%s: %d samples in %d shards, tokenizer %s", ds.name, m["rows"], len(m["shards"]), m["tokenizer_fingerprint"][:16])
    logging.info("shards: %d written, %d unchanged (left untouched) in %s", len(result.written), len(result.kept), sm.params.store)
    logging.info("provider conventions: %s", m["conventions"])
except Exception:
    logging.exception("tokens failed")
    sys.exit(1)
