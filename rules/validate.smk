rule validate:
    """Per-dataset validation.json and summary; fails (blocking extraction) above the bad-sample limit."""
    input:
        tokens=f"{RESULTS}/{{dataset}}/tokens",
        code=code_of("scripts/validate.py"),
    output:
        json=report(f"{RESULTS}/{{dataset}}/validation.json", category="Validation", labels={"dataset": "{dataset}", "file": "validation.json"}),
        summary=report(f"{RESULTS}/{{dataset}}/validation.txt", category="Validation", labels={"dataset": "{dataset}", "file": "summary"}),
    params:
        max_bad_fraction=dataset_max_bad_fraction,
        bad_counts=dataset_bad_counts,
    log:
        "logs/{dataset}/validate.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/validate.py"
