# Hidden-state extraction (HF or SGLang backend), one job per token shard, and the tiny random demo model.
# Needs from rules/common.smk: RESULTS (config["results_dir"]), weights_input(wildcards) (the weights dir
# of the dataset's model), weights_dir_input (it as an input), weight_files_input (its model
# files), weight_files_version (their names, sizes and mtimes), extract_layers, sglang_server_args,
# extract_compute_dtype, extract_shard_source and extract_shard_records (the plan's input functions).
# The final hidden state is always stored BEFORE the final norm, with the norm's weight and eps
# (eagledata.extract.norm): the SpecForge export derives the after-norm state, speculators reads it as is.
# (extraction.final_norm, removed, is refused with the config file named: eagledata.config.validate_config)


# each dataset's extraction.max_seq_len / on_long, as they decide anything (eagledata.extract.limits): a param
# of the gather, and of each shard job as it acts on that shard (extract_shard_limit: none when the shard's
# longest train sample fits), so a change reruns the shard jobs it acts on, before or after; a shard job
# keeps its stored shard when no sample of it exceeds either limit (the resume key, eagledata.extract.core.limit_key)
LENGTH_LIMITS = {
    name: length_limit((d.get("extraction") or {}).get("max_seq_len"), (d.get("extraction") or {}).get("on_long", "truncate"))
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


# Extraction runs as one job per token shard (eagledata.extract.pershard):
#   checkpoint extract_plan  after tokens and validate (validation gates extraction): hidden.work/plan.json,
#                            per stable shard key its content-named token shard in tokens.store/
#   rule extract_shard       one job per key, resources gpu = extraction.gpus_per_job (the job claims concrete
#                            devices with flock before importing torch): hidden.store/{token stem}.safetensors
#                            (+ {stem}.json, its record) and hidden.work/shards/{key}/{content}.json
#   rule extract             gather (eagledata.extract.gather): hidden/ = manifest.json, index.parquet, hard links
#                            into hidden.store/
# A shard job's inputs are its content-named token shard, the weights and the code, its params the
# settings that shape the shards: nothing another shard changes, so an unchanged shard never reruns.
# hidden.store/ is no output: Snakemake's deletion of the directory() output hidden/ cannot touch it.
HIDDEN_WORK = f"{RESULTS}/{{dataset}}/hidden.work"
HIDDEN_STORE = f"{RESULTS}/{{dataset}}/hidden.store"

for _name in ("extract_plan", "extract_shard"):
    if _name in DATASETS:
        raise ValueError(f"config: dataset name {_name!r} clashes with rule {_name}; rename it")


checkpoint extract_plan:
    """The dataset's shard keys and their content-named token shards (after validation passed)."""
    input:
        tokens=f"{RESULTS}/{{dataset}}/tokens",
        validation=f"{RESULTS}/{{dataset}}/validation.json",  # validation gates extraction
        code=code_of("scripts/extract_plan.py"),
    output:
        plan=f"{HIDDEN_WORK}/plan.json",
    log:
        "logs/{dataset}/extract_plan.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/extract_plan.py"


rule extract_shard:
    """One token shard's hidden states into the store (resume, disk check, atomic write, sanity checks)."""
    input:
        tokens=extract_shard_source,  # tokens.store/{content-named shard}: a new name iff new content
        weights=weights_dir_input,  # its path (its mtime counts only for the demo model, built by a job)
        weight_files=weight_files_input,  # the model's files one by one (not the directory's mtime)
        code=code_of("scripts/extract_shard.py"),
    output:
        # named by the token shard's content too (extract_shard_records, rules/common.smk): changed tokens need
        # a new record, so the job runs in the run that changed them
        f"{HIDDEN_WORK}/shards/{{shard}}/{{content}}.json",
    params:
        # what the shards contain: a change reruns extraction (device, batch size, GPUs do not)
        layers=extract_layers,
        dtype=config["extraction"]["dtype"],
        compute_dtype=extract_compute_dtype,
        backend=config["extraction"]["backend"],
        # SGLang's server arguments shape the states (quantization, KV-cache dtype...): a resume key too
        sglang_server_args=sglang_server_args(),
        length_limit=extract_shard_limit,
        # the model files' names, sizes and mtimes: weights swapped for older files rerun the job (its
        # resume key, the model's fingerprint, then decides whether it extracts)
        weights_version=weight_files_version,
        # read, not an input: the plan is rewritten whenever any shard changes
        plan=f"{HIDDEN_WORK}/plan.json",
        store=HIDDEN_STORE,
    resources:
        # Snakemake only counts GPUs (--resources gpu=8); the job claims concrete indices itself
        gpu=config["extraction"]["gpus_per_job"],
    threads: 2
    log:
        "logs/{dataset}/extract_shard/{shard}.{content}.log",
    benchmark:
        "benchmarks/out/{dataset}/extract_shard/{shard}.{content}.tsv"
    conda:
        "../envs/gpu.yaml"
    script:
        "../scripts/extract_shard.py"


rule extract:
    """Gather the shards: hidden/manifest.json, index.parquet and a hard link per shard."""
    input:
        plan=f"{HIDDEN_WORK}/plan.json",
        shards=extract_shard_records,
        weights=weights_dir_input,
        weight_files=weight_files_input,
        code=code_of("scripts/extract.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/hidden"),
    params:
        layers=extract_layers,
        dtype=config["extraction"]["dtype"],
        compute_dtype=config["extraction"]["compute_dtype"],
        backend=config["extraction"]["backend"],
        sglang_server_args=sglang_server_args(),
        length_limit=lambda wc: LENGTH_LIMITS[wc.dataset],
        weights_version=weight_files_version,
        # how much of what it takes out of the store it keeps (hidden.store/replaced/): a change applies now
        keep_replaced_gb=config["extraction"]["keep_replaced_gb"],
        store=HIDDEN_STORE,
    log:
        "logs/{dataset}/extract.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/extract.py"
