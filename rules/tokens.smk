# The tokens stage, one job per shard (eagledata.tokens.pershard): the checkpoint token_plan cuts a
# dataset's responses into stable shards (keys and per-shard slices of the responses), token_shard
# reconstructs one shard (the heavy step; --cores N runs N at once), token_learn learns the dataset's
# conventions from the per-shard summaries, token_repairs learns which repairs each provider is proven
# to apply, token_judge writes one final shard, and tokens gathers them into tokens/ (manifest.json and
# hard links into tokens.store/). Slices, parts and the store live under results/{dataset}/ outside any
# directory() output, so an unchanged shard keeps its files (bytes and mtimes) and reruns nothing.
# Input functions (token_shard_keys and friends) are in rules/common.smk; token_shard declares one stamp
# (stage_stamp, rules/stamps.smk) for the code of both per-shard steps and the tokenizer.


checkpoint token_plan:
    """Cut the responses into stable shards: plan.json and the slices whose records changed."""
    input:
        responses=f"{RESULTS}/{{dataset}}/responses.jsonl",
        code=code_of("scripts/token_plan.py"),
    output:
        plan=f"{TOKENS_WORK}/plan.json",
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
        # the code of both per-shard steps and the tokenizer: a change reruns this step, so the judge
        # after it (whose own inputs are the part and conventions.json only: the dry run's cost)
        stamp=stage_stamp("tokens", "scripts/token_shard.py", "scripts/token_judge.py"),
    output:
        part=f"{TOKENS_WORK}/parts/{{shard}}.parquet",
        summary=f"{TOKENS_WORK}/parts/{{shard}}.summary.json",
    log:
        "logs/{dataset}/token_shard/{shard}.log",
    benchmark:
        "benchmarks/out/{dataset}/token_shard/{shard}.tsv"
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/token_shard.py"


rule token_learn:
    """The dataset's count conventions, reasoning-count reliability and prompt variants, from the
    per-shard summaries only."""
    input:
        summaries=token_summaries,
        code=code_of("scripts/token_learn.py"),
    output:
        f"{TOKENS_WORK}/learned.json",
    log:
        "logs/{dataset}/token_learn.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/token_learn.py"


rule token_repairs:
    """Which repairs each provider is proven to apply (searched on the samples needing one)."""
    input:
        learned=f"{TOKENS_WORK}/learned.json",
        tokenizer=tokenizer_input,
        code=code_of("scripts/token_repairs.py"),
    output:
        f"{TOKENS_WORK}/conventions.json",
    params:
        # not used here: a changed policy reruns this job, so every token_judge after it
        policy=dataset_policy,
        # the parts are upstream of learned.json (see eagledata.tokens.pershard, step 4)
        plan=f"{TOKENS_WORK}/plan.json",
    log:
        "logs/{dataset}/token_repairs.log",
    benchmark:
        "benchmarks/out/{dataset}/token_repairs.tsv"
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/token_repairs.py"


rule token_judge:
    """One final shard: verdicts under the learned conventions, repairs, the policy's train column."""
    input:
        part=f"{TOKENS_WORK}/parts/{{shard}}.parquet",
        conventions=f"{TOKENS_WORK}/conventions.json",  # also carries code, tokenizer and policy changes
    output:
        f"{TOKENS_WORK}/judged/{{shard}}.json",
    params:
        store=f"{RESULTS}/{{dataset}}/tokens.store",
    log:
        "logs/{dataset}/token_judge/{shard}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/token_judge.py"


# The shards live in {dataset}/tokens.store, which is not an output: Snakemake deletes a directory()
# output before rerunning its job, so the declared tokens/ holds manifest.json and hard links to the
# stored shards, and a shard whose content did not change keeps its file, bytes and mtime.
rule tokens:
    """Gather the judged shards: tokens/manifest.json and a hard link per shard."""
    input:
        judged=token_judged,
        conventions=f"{TOKENS_WORK}/conventions.json",
        tokenizer=tokenizer_input,
        code=code_of("scripts/tokens.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/tokens"),
    params:
        plan=f"{TOKENS_WORK}/plan.json",
        policy=dataset_policy,
        store=f"{RESULTS}/{{dataset}}/tokens.store",
    log:
        "logs/{dataset}/tokens.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/tokens.py"
