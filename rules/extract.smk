# Hidden-state extraction (HF or SGLang backend) and the tiny random demo model.
# Needs from rules/common.smk: RESULTS (config["results_dir"]) and weights_input(wildcards)
# (the weights dir of the dataset's model).
# The final hidden state is always stored BEFORE the final norm, with the norm's weight and eps
# (eagledata.extract.norm): the SpecForge export derives the after-norm state, speculators reads it as is.

if "final_norm" in config["extraction"]:
    raise ValueError(
        f"config extraction.final_norm ({config['extraction']['final_norm']!r}) was removed: every extraction "
        "stores the final hidden state BEFORE the final norm with the norm's weight and epsilon, and both exports "
        "(export.specforge: after the norm, derived; export.speculators: before it) read one extraction; "
        "delete extraction.final_norm from the config"
    )


# each dataset's extraction.max_seq_len / on_long: a rule param, so a change reruns its extraction
LENGTH_LIMITS = {
    name: {"max_seq_len": (d.get("extraction") or {}).get("max_seq_len"),
           "on_long": (d.get("extraction") or {}).get("on_long", "truncate")}
    for name, d in config["datasets"].items()
}


rule demo_model:
    input:
        tokenizer=f"{RESULTS}/_assets/demo-tokenizer",
        code=code_of("scripts/build_demo_model.py"),
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
        code=code_of("scripts/extract.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/hidden"),
    params:
        # what the shards contain: a change reruns extraction (device, batch size, GPUs do not)
        layers=config["extraction"]["layers"],
        dtype=config["extraction"]["dtype"],
        compute_dtype=config["extraction"]["compute_dtype"],
        backend=config["extraction"]["backend"],
        length_limit=lambda wc: LENGTH_LIMITS[wc.dataset],
    resources:
        # Snakemake only counts GPUs (--resources gpu=8); the job claims concrete indices itself
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
