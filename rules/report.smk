# Reports a person reads (eagledata.report.build): one HTML per dataset (the worst samples decoded token by
# token with the implicated tokens highlighted), one for the whole run, the run-wide validation.json
# and routing advice. Self-contained HTML; all of it is embedded by `snakemake --report report.zip`.
# Needs RESULTS, DATASETS, built_tokenizer (rules/common.smk) and TOKENS_STAMP (rules/tokens.smk: the
# tokenizer by content). Settings: config key `report`
# (eagledata.report.settings.REPORT_DEFAULTS).
from eagledata.report.settings import report_settings

REPORT_SETTINGS = canonical(report_settings(config))  # keys sorted: see canonical
REPORT_CODE = code_of("scripts/report.py", "templates/report.html.jinja")


rule report_dataset:
    """One dataset's HTML report."""
    input:
        validation=f"{RESULTS}/{{dataset}}/validation.json",
        tokens=f"{RESULTS}/{{dataset}}/tokens",
        stamp=TOKENS_STAMP,
        tokenizer=built_tokenizer,
        code=REPORT_CODE,
    output:
        html=report(f"{RESULTS}/{{dataset}}/report.html", category="Report", subcategory="Datasets", labels={"dataset": "{dataset}", "file": "report.html"}),
    params:
        settings=REPORT_SETTINGS,
        run_html=f"{RESULTS}/report.html",
    log:
        "logs/{dataset}/report.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/report.py"


rule report:
    """Run-wide HTML report, validation.json (counts summed over datasets) and routing advice."""
    input:
        validation=expand(f"{RESULTS}/{{dataset}}/validation.json", dataset=DATASETS),
        tokens=expand(f"{RESULTS}/{{dataset}}/tokens", dataset=DATASETS),
        reports=expand(f"{RESULTS}/{{dataset}}/report.html", dataset=DATASETS),
        code=REPORT_CODE,
    output:
        html=report(f"{RESULTS}/report.html", category="Report", subcategory="Run", labels={"scope": "run", "file": "report.html"}),
        json=report(f"{RESULTS}/validation.json", category="Report", subcategory="Run", labels={"scope": "run", "file": "validation.json"}),
        advice=report(f"{RESULTS}/routing_advice.yaml", category="Report", subcategory="Run", labels={"scope": "run", "file": "routing_advice.yaml"}),
    params:
        settings=REPORT_SETTINGS,
        datasets=DATASETS,
    log:
        "logs/report.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/report.py"
