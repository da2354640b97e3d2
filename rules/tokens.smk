rule tokens:
    """Reconstruct exact token ids for every response and judge each against billed counts."""
    input:
        responses=f"{RESULTS}/{{dataset}}/responses.jsonl",
        tokenizer=tokenizer_input,
        code=code_of("scripts/tokens.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/tokens"),
    params:
        shard_size=config["tokens"]["shard_size"],
        policy=dataset_policy,
    log:
        "logs/{dataset}/tokens.log",
    benchmark:
        "benchmarks/out/{dataset}/tokens.tsv"
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/tokens.py"
