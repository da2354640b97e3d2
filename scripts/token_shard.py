"""Entry for rule `token_shard` (plumbing only; the job is eagledata.tokens.pershard.run_shard_job), run as a
shell command rather than through Snakemake's script directive (one job per shard: its preamble would cost
each about 0.25 s). The job runs in a warm worker where one can be used, else in this process
(eagledata.tokens.warmjobs); the tokenizer's settings are read from the stage stamp the rule declares.

    python scripts/token_shard.py --slice S --stamp T --part P --summary J --log L
"""
import sys

from eagledata.tokens.warmjobs import job_arguments, main

main(job_arguments(sys.argv[1:]))
