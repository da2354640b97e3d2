# Exports of the hidden states into trainers' own layouts (eagledata.export.trainers):
#   results/{dataset}/export/specforge    SpecForge offline: rows_{g}-{g_end}/data_{i}.ckpt (after the final norm,
#                                         derived) + vocab_mapping/vocab_mapping.pt
#   results/{dataset}/export/speculators  vLLM speculators: datasets dir + hidden_states/hs_{i}.safetensors (before
#                                         the final norm) + d2t.npy, t2d.npy, token_freq.pt
# Both read one extraction; enabled per trainer with export.specforge / export.speculators (both default true).
# Per-shard files live in the undeclared results/{dataset}/export/{kind}.store (unchanged shards are not rewritten).
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
        # SpecForge's alone: a change reruns its exports, not the speculators ones
        group_size=lambda w: config["export"]["specforge_group_size"] if w.kind == "specforge" else None,
        dtype=lambda w: config["export"][f"{w.kind}_dtype"],
        draft_vocab_size=config["export"]["draft_vocab_size"],
        # how much of what it takes out of its store it keeps ({kind}.store/replaced/): a change applies now
        keep_replaced_gb=config["export"]["keep_replaced_gb"],
    log:
        "logs/{dataset}/export_{kind}.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/export.py"


if "export" in DATASETS:
    raise ValueError("config: dataset name 'export' clashes with rule export; rename it")
