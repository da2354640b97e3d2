"""Snakemake entry for rule extract (results/{dataset}/hidden): gather the per-shard jobs' hidden shards
into manifest.json, index.parquet and hard links into the store. Plumbing only; the logic is
eagledata.extract.gather.gather_hidden."""

import logging

from eagledata.codeinputs import verify_loaded_code
from eagledata.extract.gather import gather_hidden
from eagledata.extract.pershard import ExtractionSettings

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.extract")

try:
    verify_loaded_code(smk.input.code)  # the code imported is the code stamped (and again at the end)
    settings = ExtractionSettings.from_config(smk.config, smk.wildcards.dataset, smk.input.weights)
    gather_hidden(smk.input.plan, smk.input.shards, smk.output[0], smk.params.store, settings)
    verify_loaded_code(smk.input.code)
except Exception:
    log.exception("gathering the hidden shards failed")
    raise
