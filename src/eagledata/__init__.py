"""eagledata: prompts -> responses -> exact token ids -> validation -> EAGLE-3 hidden states.

The library behind the Snakemake workflow; every stage is importable and usable without Snakemake.
"""


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's (pyproject.toml), read when asked: a version
    written here would be code every stage's stamp counts, so a release would rerun every stage and
    re-extract every hidden state."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("eagledata")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'eagledata' has no attribute {name!r}")
