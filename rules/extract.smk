# Hidden-state extraction (Hugging Face backend) and the tiny random demo model.
# Needs from rules/common.smk: RESULTS (config["results_dir"]) and weights_input(wildcards)
# (the weights dir of the dataset's model).


rule demo_model:
    input:
        tokenizer=f"{RESULTS}/_assets/demo-tokenizer",
        code="src/eagledata/demo_model.py",
    output:
        directory(f"{RESULTS}/_assets/demo-model"),
    params:
        seed=0,
    log:
        "logs/_assets/demo_model.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/build_demo_model.py"


rule extract:
    input:
        tokens=f"{RESULTS}/{{dataset}}/tokens",
        validation=f"{RESULTS}/{{dataset}}/validation.json",  # validation gates extraction
        weights=weights_input,
        code="src/eagledata/extract.py",
    output:
        directory(f"{RESULTS}/{{dataset}}/hidden"),
    resources:
        gpu=config["extraction"]["gpus_per_job"],
    threads: 2
    log:
        "logs/{dataset}/extract.log",
    benchmark:
        "benchmarks/out/{dataset}/extract.tsv"
    conda:
        "../envs/gpu.yaml"
    script:
        "../scripts/extract.py"
