"""Snakemake entry for rule ``demo_tokenizer``: build the demo tokenizer directory.

Argument plumbing only; the work is :func:`eagledata.demo.tokenizer.build_demo_tokenizer`.
Command line: ``python scripts/build_demo_tokenizer.py OUT_DIR [CORPUS]``.
"""


import logging
import sys

from eagledata.demo.tokenizer import build_demo_tokenizer


def main(out_dir: str, corpus: str | None = None, log_file: str | None = None) -> None:
    handler: logging.Handler = logging.FileHandler(log_file, mode="w") if log_file else logging.StreamHandler()
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        build_demo_tokenizer(corpus, out_dir)
    except Exception:
        logging.getLogger("build_demo_tokenizer").exception("building the demo tokenizer failed")
        raise


if "snakemake" in globals():
    from eagledata.codeinputs import verify_loaded_code

    smk = globals()["snakemake"]
    verify_loaded_code(smk.input.code)  # the code imported is the code stamped (and again at the end)
    main(smk.output[0], corpus=getattr(smk.input, "corpus", None),
         log_file=smk.log[0] if smk.log else None)
    verify_loaded_code(smk.input.code)
elif __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: build_demo_tokenizer.py OUT_DIR [CORPUS]")
    main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None)
