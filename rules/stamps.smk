# Stamps (eagledata.codeinputs.write_stamp): one small file per stage script (code_of in common.smk)
# and, for the per-shard rules, per dataset and script (stage_stamp), which the rules declare instead of the files they hash. A stamp job reruns
# only on a content change of a file it hashes (Snakemake compares recorded checksums of a newer
# input), and then every job declaring the stamp reruns.


# The stamps (eagledata.codeinputs.write_stamp): rerun on a content change of a file they hash.
rule code_stamp:
    """The sha256 of every file a stage script imports (code_of)."""
    input:
        lambda wildcards: CODE_STAMPS[wildcards.name],
    output:
        f"{STAMPS}/scripts/{{name}}.sha256",
    wildcard_constraints:
        name="[A-Za-z0-9_.+-]+",
    log:
        "logs/_code/scripts/{name}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/code_stamp.py"


rule stage_stamp:
    """A stage stamp (stage_stamp): the code stamps of its scripts and the dataset model's tokenizer files."""
    input:
        code=lambda wildcards: STAGE_STAMPS[wildcards.name],
        tokenizer=tokenizer_input,
    output:
        f"{STAMPS}/datasets/{{dataset}}/{{name}}.sha256",
    wildcard_constraints:
        name="[A-Za-z0-9_.+-]+",
    log:
        "logs/_code/datasets/{dataset}/{name}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/code_stamp.py"
