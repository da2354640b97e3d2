"""Snakemake entry for rules `report_dataset` and `report` (plumbing only; logic in eagledata.report.build)."""
import logging
import os
import sys

from eagledata.codeinputs import verify_loaded_code
from eagledata.config import load_model_tokenizer
from eagledata.report.build import build_dataset_report, build_run_report

sm = snakemake  # noqa: F821 - injected by Snakemake
logging.basicConfig(filename=sm.log[0], level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
try:
    verify_loaded_code(sm.input.code)  # the code imported is the code stamped (and again at the end)
    if sm.rule == "report_dataset":
        name = sm.wildcards.dataset
        tokenizer = load_model_tokenizer(sm.config, sm.config["datasets"][name]["model"])
        run_html = os.path.relpath(sm.params.run_html, os.path.dirname(sm.output.html))
        ctx = build_dataset_report(sm.input.validation, sm.input.tokens, sm.output.html, tokenizer,
                                   sm.params.settings, run_report=run_html)
        logging.info("%s: report with %d worst samples of %d flagged", name, len(ctx["samples"]), ctx["n_flagged"])
    else:
        names = list(sm.params.datasets)
        datasets = {n: (v, t) for n, v, t in zip(names, sm.input.validation, sm.input.tokens)}
        links = {n: os.path.relpath(h, os.path.dirname(sm.output.html)) for n, h in zip(names, sm.input.reports)}
        ctx = build_run_report(datasets, sm.output.html, sm.output.json, sm.output.advice, sm.params.settings, links)
        advice = ctx["advice"]
        logging.info("run report over %s; routing advice: order %s, ignore %s", names, advice["order"], advice["ignore"])
    verify_loaded_code(sm.input.code)
except Exception:
    logging.exception("%s failed", sm.rule)
    sys.exit(1)
