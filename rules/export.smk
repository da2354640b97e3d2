# Exports of the hidden states into trainers' own layouts (eagledata.export.trainers):
#   results/{dataset}/export/specforge    SpecForge offline: rows_{g}-{g_end}/data_{i}.ckpt (needs final_norm: after)
#   results/{dataset}/export/speculators  vLLM speculators: hidden_states/hs_{i}.safetensors (needs final_norm: before)
# Enabled per trainer with export.specforge (default true) / export.speculators (default false).
# Targets: export_targets(name) / export_all_targets() in rules/common.smk.

rule export:
    input:
        hidden=f"{RESULTS}/{{dataset}}/hidden",
        code=code_of("scripts/export.py"),
    output:
        directory(f"{RESULTS}/{{dataset}}/export/{{kind}}"),
    wildcard_constraints:
        kind="specforge|speculators",
    params:
        kind="{kind}",
        group_size=config["export"]["specforge_group_size"],
    log:
        "logs/{dataset}/export_{kind}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/export.py"


if "export" in DATASETS:
    raise ValueError("config: dataset name 'export' clashes with rule export; rename it")
