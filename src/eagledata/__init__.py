"""eagledata: prompts -> responses -> exact token ids -> validation -> EAGLE-3 hidden states.

The library behind the Snakemake workflow; every stage is importable and usable without Snakemake.
"""

__version__ = "0.1.0"
