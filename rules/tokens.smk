# The shards live in {dataset}/tokens.store, which is not an output: Snakemake deletes a directory()
# output before rerunning its job, so the declared tokens/ holds manifest.json and hard links to the
# stored shards, and a shard whose content did not change keeps its file, bytes and mtime
# (see eagledata.tokens.shards).
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
        store=f"{RESULTS}/{{dataset}}/tokens.store",
    log:
        "logs/{dataset}/tokens.log",
    benchmark:
        "benchmarks/out/{dataset}/tokens.tsv"
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/tokens.py"
