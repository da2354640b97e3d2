# eagledata: prompts -> responses -> exact token ids -> validation -> EAGLE-3 hidden states.
# Targets: `all` (every dataset), or one rule per dataset named after it (`snakemake --cores 8 B3`).
from snakemake.utils import min_version, validate

from eagledata.config import validate_workflow_config

min_version("9.0")


# The embedded demo config applies only when no --configfile is given: Snakemake would otherwise
# deep-merge a real config into the demo's datasets.
if not config:

    configfile: "config/config.yaml"


# Ours first: every object of the schema is closed, and this names the config file, the key path and
# the nearest known key (Snakemake's validate names neither); then Snakemake's, same schema.
validate_workflow_config(config, workflow.configfiles)
validate(config, "config/schema.yaml")


include: "rules/common.smk"
include: "rules/stamps.smk"
include: "rules/demo.smk"
include: "rules/generate.smk"
include: "rules/tokens.smk"
include: "rules/validate.smk"
include: "rules/extract.smk"
include: "rules/export.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        all_targets(),
        export_all_targets(),
        f"{RESULTS}/report.html",
        f"{RESULTS}/validation.json",
        f"{RESULTS}/routing_advice.yaml",


for _dataset in DATASETS:

    rule:
        name:
            _dataset
        input:
            dataset_targets(_dataset),
            export_targets(_dataset),
