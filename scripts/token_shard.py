"""Entry for rule `token_shard` (plumbing only; logic in eagledata.tokens.pershard), run as a shell
command rather than through Snakemake's script directive (one job per shard: its preamble would cost
each about 0.25 s); the tokenizer's settings are read from the stage stamp the rule declares.

    python scripts/token_shard.py --slice S --stamp T --part P --summary J --log L
"""
import argparse
import logging

from eagledata.codeinputs import stamp_settings, verify_loaded_code
from eagledata.config import tokenizer_from_settings
from eagledata.io import quick_exit
from eagledata.tokens.pershard import peak_memory_mb, reconstruct_shard, slice_sources

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
for name in ("slice", "stamp", "part", "summary", "log"):
    ap.add_argument(f"--{name}", required=True)
args = ap.parse_args()
logging.basicConfig(filename=args.log, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    verify_loaded_code([args.stamp])  # the code imported is the code stamped (and again at the end)
    tokenizer, family = tokenizer_from_settings(stamp_settings(args.stamp))
    where, responses = slice_sources(args.slice)
    reconstruct_shard(args.slice, where, responses, args.part, args.summary, tokenizer, family)  # logs where its time went
    logging.info("peak memory %.0f MB", peak_memory_mb())
    verify_loaded_code([args.stamp])
except Exception:
    logging.exception("token_shard failed")
    quick_exit(1)
quick_exit(0)  # one job per shard: the interpreter's teardown would cost each about 0.15 s
