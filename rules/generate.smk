# Responses for every dataset: generated (rule generate) or imported (rule import_responses).
# Paid responses live in the resumable cache {cache_dir}/{dataset}/responses.jsonl, which is NOT an
# output: a failed or killed job keeps them, and a rerun requests only what is missing. Parallel
# generate jobs share the budget ledger {cache_dir}/budget.sqlite (not an output either). The input
# and params functions are methods of eagledata.generate.ruleinputs.GenerateRuleInputs (bound to config in
# rules/common.smk as generate_inputs) and generate_tokenizer (rules/common.smk).
rule generate:
    """Send every prompt (x samples) to the dataset's backend; exact bodies, resumable cache."""
    input:
        prompts=generate_inputs.prompts,
        tokenizer=generate_tokenizer,
        # where `eagledata retry` forgot final errors: its note, newer than the outputs (else nothing)
        retried=generate_inputs.retried,
    output:
        responses=f"{RESULTS}/{{dataset}}/responses.jsonl",
        summary=f"{RESULTS}/{{dataset}}/generation_summary.json",
    params:
        # output-shaping settings only: changing one reruns the rule, and the cache makes that
        # rerun request only the samples whose request body changed (budget, concurrency and
        # timeouts are read in the job and rerun nothing)
        request=generate_inputs.request,
    wildcard_constraints:
        dataset=regex_of(GENERATED_DATASETS),
    log:
        "logs/{dataset}/generate.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/generate.py"


rule import_responses:
    """Validate and copy an existing responses file (recorded format) as the dataset's responses."""
    input:
        generate_inputs.imported,
    output:
        f"{RESULTS}/{{dataset}}/responses.jsonl",
    wildcard_constraints:
        dataset=regex_of(IMPORTED_DATASETS),
    log:
        "logs/{dataset}/import_responses.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/import_responses.py"
