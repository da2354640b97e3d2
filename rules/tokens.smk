# The tokens stage (eagledata.tokens.pershard): the checkpoint token_plan cuts a dataset's responses
# into stable shards (keys, and per shard a slice: its ids and records' digests), token_shard reconstructs one shard
# (the heavy step, one job per shard: --cores N runs N at once), and tokens learns the dataset's
# conventions from the per-shard summaries, the repairs each provider is proven to apply, judges every
# shard and gathers them into tokens/ (manifest.json and hard links into tokens.store/). Slices, parts
# and the store live under results/{dataset}/ outside any directory() output, so an unchanged shard
# keeps its files (bytes and mtimes) and reruns nothing. Input functions (token_parts and friends) are
# in rules/common.smk; token_shard declares one stamp (TOKENS_STAMP: stage_stamp, written while the
# workflow is parsed) for its code, the tokenizer's files and its settings (which the job reads from it).


# The code of token_shard and the dataset model's tokenizer (files and settings): one stamp per dataset
# (an input function: the stamp's name is its content's).
TOKENS_STAMP = stage_stamp("tokens", "scripts/token_shard.py")


checkpoint token_plan:
    """Cut the responses into stable shards: plan.json and the slices whose records changed."""
    input:
        responses=f"{RESULTS}/{{dataset}}/responses.jsonl",
        code=code_of("scripts/token_plan.py"),
        # not read: where a job builds the tokenizer (the demo's), so that a run that rebuilds it also
        # checks this job's own inputs (Snakemake checks none of the jobs after one that must run, and
        # reaches them from it, but not through generate's ancient() tokenizer of paid backends)
        tokenizer=built_tokenizer,
    output:
        plan=f"{TOKENS_WORK}/plan.json",
    # a large responses file is read in several processes (eagledata.tokens.planscan)
    threads: token_plan_threads
    params:
        shard_size=config["tokens"]["shard_size"],
        slices=f"{TOKENS_WORK}/slices",
    log:
        "logs/{dataset}/token_plan.log",
    benchmark:
        "benchmarks/out/{dataset}/token_plan.tsv"
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/token_plan.py"


rule token_shard:
    """Reconstruct the exact token ids of one shard's samples; a summary of what they teach."""
    input:
        slice=f"{TOKENS_WORK}/slices/{{shard}}.tsv",
        # the code of this step and the tokenizer, one file per dataset
        stamp=TOKENS_STAMP,
        # the demo's tokenizer, which a job builds (named in the stamp, not hashed); else nothing
        tokenizer=built_tokenizer,
    output:
        part=f"{TOKENS_WORK}/parts/{{shard}}.parquet",
        summary=f"{TOKENS_WORK}/parts/{{shard}}.summary.json",
    # the larger shards first (its rows, from the plan)
    priority: token_shard_priority
    log:
        "logs/{dataset}/token_shard/{shard}.log",
    benchmark:
        "benchmarks/out/{dataset}/token_shard/{shard}.tsv"
    conda:
        "../envs/core.yaml"
    # a shell command, not script: (EAGLEDATA_PYTHON and EAGLEDATA_SCRIPTS: set in the Snakefile); the
    # tokenizer settings come from the stamp. The job runs in a warm worker where it can
    # (eagledata.tokens.warmjobs; EAGLEDATA_WARM_WORKERS=0 turns them off): the benchmark: file then
    # measures the job's own process, not the worker; the job's log has its peak memory.
    shell:
        '"$EAGLEDATA_PYTHON" "$EAGLEDATA_SCRIPTS/token_shard.py" --slice {input.slice:q} --stamp {input.stamp:q} '
        "--part {output.part:q} --summary {output.summary:q} --log {log:q}"


# The shards live in {dataset}/tokens.store, which is not an output: Snakemake deletes a directory()
# output before rerunning its job, so the declared tokens/ holds manifest.json and hard links to the
# stored shards, and a shard whose content did not change keeps its file, bytes and mtime.
rule tokens:
    """Learn the dataset's conventions and repairs from the shards, judge each shard, gather them:
    tokens/manifest.json and a hard link per shard (learned.json, conventions.json in tokens.work/)."""
    input:
        parts=token_parts,
        summaries=token_summaries,
        # the tokenizer by its files' content (a touched vocabulary reruns nothing) and settings
        stamp=TOKENS_STAMP,
        tokenizer=built_tokenizer,
        code=code_of("scripts/tokens.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/tokens"),
    # judging runs in this many processes (one shard each at a time) when there are enough shards
    threads: min(8, workflow.cores)
    params:
        # upstream of the parts; not an input, so a plan rewritten with the same shards reruns nothing
        plan=f"{TOKENS_WORK}/plan.json",
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
