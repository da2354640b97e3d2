# eagledata: prompts -> responses -> exact token ids -> validation -> EAGLE-3 hidden states.
# Targets: `all` (every dataset), or one rule per dataset named after it (`snakemake --cores 8 B3`).
import json
import os
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod
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

# A rule that runs its script as a shell command (token_shard: one job per shard, where the script
# directive's preamble, importing snakemake.script, costs every job about 0.25 s) calls
# "$EAGLEDATA_PYTHON" "$EAGLEDATA_SCRIPTS/NAME.py": the interpreter the script directive would pick
# (this Snakemake's own; the rule's conda env's `python` under --sdm conda: the rules declare conda
# envs, no container or module) and this workflow's scripts/. Environment variables, not paths in the
# command, so a moved checkout does not change the rule's code (which would rerun every shard).
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    os.environ["EAGLEDATA_PYTHON"] = "python"
else:
    os.environ["EAGLEDATA_PYTHON"] = sys.executable
os.environ["EAGLEDATA_SCRIPTS"] = str(Path(workflow.basedir) / "scripts")
# The config files this run read, for the commands a job's messages suggest (eagledata retry --config);
# set in every process that parses the workflow (a job run elsewhere parses it with the same files).
os.environ["EAGLEDATA_CONFIGFILES"] = json.dumps([str(f) for f in workflow.configfiles])


envvars:
    "EAGLEDATA_PYTHON",
    "EAGLEDATA_SCRIPTS",
    "EAGLEDATA_CONFIGFILES",


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/generate.smk"
include: "rules/tokens.smk"
include: "rules/validate.smk"
include: "rules/extract.smk"
include: "rules/export.smk"
include: "rules/report.smk"


# The stamps this process wrote (rules/common.smk), for the jobs run elsewhere to declare the same.
if workflow.is_main_process:
    os.environ["EAGLEDATA_STAMPS"] = json.dumps(ALL_STAMPS, sort_keys=True)


envvars:
    "EAGLEDATA_STAMPS",


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
