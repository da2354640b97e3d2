# Stamps (eagledata.codeinputs.write_stamp): one small file per stage script (code_of in common.smk)
# and, for the per-shard token jobs, one per dataset (stage_stamp: code and tokenizer files), which the
# rules declare instead of the files they hash. A stamp job reruns only on a content change of a file
# it hashes (Snakemake compares the recorded checksums of a newer input), and then every job declaring
# the stamp reruns. Local: a cluster job for a hash of a few files would cost more than the hash.


localrules:
    code_stamp,
    stage_stamp,


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
    """A stage stamp (stage_stamp): the code stamps of its scripts, the dataset model's tokenizer files
    and its tokenizer settings (a family, template or hub id changed in the config reruns the shards)."""
    input:
        code=lambda wildcards: STAGE_STAMPS[wildcards.name],
        tokenizer=tokenizer_input,
    output:
        f"{STAMPS}/datasets/{{dataset}}/{{name}}.sha256",
    params:
        settings=tokenizer_settings,
    wildcard_constraints:
        name="[A-Za-z0-9_.+-]+",
    log:
        "logs/_code/datasets/{dataset}/{name}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/code_stamp.py"
