"""Snakemake entry for rule demo_model: the tiny random DeepseekV3 used by the embedded demo.

Plumbing only; the logic is eagledata.demo.model.build_demo_model.
"""

import logging

from eagledata.codeinputs import verify_loaded_code
from eagledata.demo.model import build_demo_model
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.build_demo_model")

try:
    verify_loaded_code(smk.input.code)  # the code imported is the code stamped (and again at the end)
    tok = load_tokenizer(smk.input.tokenizer, get_family("kimi-k2.5"))
    seed = int(getattr(smk.params, "seed", 0))
    out = build_demo_model(smk.output[0], tok.vocab_size, seed=seed)
    log.info("built demo model at %s (vocabulary %d, seed %d)", out, tok.vocab_size, seed)
    verify_loaded_code(smk.input.code)
except Exception:
    log.exception("demo model build failed")
    raise
