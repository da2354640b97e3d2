# Helpers shared by every stage: resolved settings, paths, input functions.
import functools
import hashlib
import json
import os
import re
from pathlib import Path

from eagledata.codeinputs import DIGESTS_CACHE, package_dir_for, stage_code, stamp_file
from eagledata.config import dataset_settings, validate_config, workflow_asset
from eagledata.extract.limits import length_limit
from eagledata.extract.weights import compute_setting, layers_setting, model_files
from eagledata.generate.prompts import canonical
from eagledata.generate.requests import TOKENIZER_IDENTITY
from eagledata.generate.ruleinputs import GenerateRuleInputs
from eagledata.tokens.planfile import plan_keys, plan_processes, plan_shard_rows
from eagledata.tokens.policy import validation_setting

validate_config(config, "config")  # same defaults and cross-checks as the library

RESULTS = config["results_dir"]
DATASETS = list(config["datasets"])
IMPORTED_DATASETS = [d for d in DATASETS if config["datasets"][d].get("responses")]
GENERATED_DATASETS = [d for d in DATASETS if d not in IMPORTED_DATASETS]
# The files a tokenizer directory's loaders read (tiktoken, Hugging Face fast and slow tokenizers and
# the model config AutoTokenizer reads; weights are never among them), and its code (trust_remote_code).
TOKENIZER_FILES = ("tiktoken.model", "pattern.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "config.json")
TOKENIZER_GLOBS = ("tokenization_*.py", "*.tiktoken")  # its code (trust_remote_code) and vocabularies named by it
# Code inputs: every project module a rule's script imports (transitively, eagledata.codeinputs),
# plus data files it reads. Editing any of them reruns that rule and what follows; generation
# declares none, so no code change ever re-sends a paid request. A rule declares one stamp per script,
# not the files: thousands of per-shard jobs with some 25 inputs each made the dry run slow. The stamps
# are written here, while the workflow is parsed, named by their content (stamp_file: never rewritten,
# so a Snakemake started during a run, say a dry run, changes nothing a running job declared): an edit
# that changes no stamp (a comment, a docstring, the version) reruns nothing, a code change gives the
# rules another stamp to declare. A job run elsewhere (--executor slurm) parses the workflow again: it
# takes the main process's stamps (EAGLEDATA_STAMPS, passed to jobs; the Snakefile sets it) rather than
# the code on disk when it starts, so a job that runs code edited since fails its check
# (eagledata.codeinputs.verify_loaded_code) instead of being recorded as the stamped code's.
WORKFLOW_DIR = Path(workflow.main_snakefile).resolve().parent
PACKAGE_DIR = package_dir_for(WORKFLOW_DIR)
STAMPS = f"{RESULTS}/_code"
ALL_STAMPS = {}  # "scripts/{name}" or "datasets/{dataset}/{name}" -> its stamp file
_GIVEN_STAMPS = {} if workflow.is_main_process else json.loads(os.environ.get("EAGLEDATA_STAMPS") or "{}")
CODE_STAMPS = {}  # stamp name -> its file


def code_files(script, *data, shell=False):
    """Module files ``script`` (relative to the Snakefile) imports, then ``data`` files of the package;
    with ``shell`` (a rule that runs it as a shell command, which Snakemake does not track as it
    tracks a ``script:``), and ``script`` itself."""
    files = stage_code(WORKFLOW_DIR / script, PACKAGE_DIR, Path.cwd(), cache_file=".snakemake/eagledata/imports.json")
    cwd = Path.cwd().resolve()
    extra = [(WORKFLOW_DIR / script).resolve()] if shell else []
    for path in extra + [(PACKAGE_DIR / "data" / name).resolve() for name in data]:
        files.append(str(path.relative_to(cwd)) if cwd in path.parents else str(path))
    return files


def code_of(script, *data, shell=False):
    """The code input of the rules that run ``script``: the stamp of :func:`code_files` (one file,
    written now)."""
    name = Path(script).stem
    if data:
        name = f"{name}+{hashlib.sha256(chr(0).join(data).encode('utf-8')).hexdigest()[:8]}"
    if name not in CODE_STAMPS:
        CODE_STAMPS[name] = ALL_STAMPS[f"scripts/{name}"] = _GIVEN_STAMPS.get(f"scripts/{name}") or str(
            stamp_file(code_files(script, *data, shell=shell), f"{STAMPS}/scripts", name, cache_file=DIGESTS_CACHE,
                       base=WORKFLOW_DIR))
    return [CODE_STAMPS[name]]


def regex_of(names):
    return "|".join(re.escape(n) for n in names) if names else "(?!x)x"


def settings(name):
    return dataset_settings(config, name)


def model_of(wildcards):
    return config["models"][config["datasets"][wildcards.dataset]["model"]]


def tokenizer_files(model_name):
    """The tokenizer's files, so a changed vocabulary or template reruns tokens and downstream.
    A path a rule builds (the demo tokenizer) is returned as the directory itself; a hub id
    (no local path) contributes nothing: its identity is in params."""
    model = config["models"][model_name]
    tok = model["tokenizer"]
    files = [model["chat_template"]] if model.get("chat_template") else []
    if _built(tok):
        return [tok] + files
    path = Path(tok)
    if path.is_dir():
        code = sorted({str(p) for g in TOKENIZER_GLOBS for p in path.glob(g) if p.is_file()})
        return [str(path / f) for f in TOKENIZER_FILES if (path / f).exists()] + code + files
    return files


def _built(path):
    """Whether a job of this workflow makes ``path`` (the demo's assets)."""
    return workflow_asset(path, config)


def tokenizer_input(wildcards):
    """The tokenizer's files (:func:`tokenizer_files`) of the dataset's model."""
    return tokenizer_files(config["datasets"][wildcards.dataset]["model"])


def tokenizer_settings(dataset):
    """What of the config decides a dataset's token ids besides its tokenizer's files: the model's
    tokenizer (a hub id has no files) and its pinned revision, how it is loaded, its chat template and
    its family, with the config's definition of that family. A line of the dataset's stage stamp, so a
    change reruns the per-shard jobs that declare the stamp."""
    model = config["models"][config["datasets"][dataset]["model"]]
    keys = (*TOKENIZER_IDENTITY, "chat_template", "family")
    return canonical({**{k: model.get(k) for k in keys},
                      "family_definition": (config.get("families") or {}).get(model["family"])})


def stage_stamp(name, *scripts):
    """One stamp per dataset (written now) of the code stamps of ``scripts``, the dataset model's
    tokenizer files and its tokenizer settings, for the per-shard jobs: one input, a dict lookup. Those
    jobs run ``scripts`` as shell commands, so the scripts are stamped too. A tokenizer a job builds is
    named, not hashed (its files may not exist yet): the jobs declare it (:func:`built_tokenizer`)."""
    code = [code_of(s, shell=True)[0] for s in scripts]
    stamps = {}
    for dataset in DATASETS:
        key = f"datasets/{dataset}/{name}"
        files = tokenizer_files(config["datasets"][dataset]["model"])
        stamps[dataset] = ALL_STAMPS[key] = _GIVEN_STAMPS.get(key) or str(
            stamp_file(code + [f for f in files if not _built(f)], f"{STAMPS}/datasets/{dataset}", name,
                       settings=tokenizer_settings(dataset), built=[f for f in files if _built(f)], cache_file=DIGESTS_CACHE))
    return lambda wildcards: stamps[wildcards.dataset]


def built_tokenizer(wildcards):
    """The dataset's tokenizer where a job builds it (the demo's), else nothing."""
    return [f for f in tokenizer_input(wildcards) if _built(f)]


def weights_input(wildcards):
    weights = model_of(wildcards).get("weights")
    if not weights:
        raise ValueError(f"dataset {wildcards.dataset}: model has no 'weights' for extraction")
    return weights


def weights_dir_input(wildcards):
    """The weights directory as an input: ancient() (its mtime counts for nothing) but where a job
    builds it (the demo model: that job's output). A directory's own mtime changes with any file
    added to or replaced in it (notes, a re-downloaded generation_config.json); the model's files
    count one by one instead (weight_files_input)."""
    weights = weights_input(wildcards)
    return weights if _built(weights) else ancient(weights)


def extract_layers(wildcards):
    """extraction.layers as it decides the shards (a param of each shard job): the default layers written
    out read as the default (null), so writing them out reruns no job (eagledata.extract.weights)."""
    return _layers_setting(weights_input(wildcards))


def sglang_server_args():
    """extraction.sglang_server_args where they shape the states (the sglang backend), else none."""
    ext = config["extraction"]
    return canonical((ext.get("sglang_server_args") or {}) if ext["backend"] == "sglang" else {})


def extract_compute_dtype(wildcards):
    """extraction.compute_dtype as it decides the forward (a param of each shard job). With the hf backend, the dtype
    the checkpoint declares reads as auto (what HF's auto loads), so writing it out reruns no job (the
    stored shards' resume key counts both as one too: eagledata.extract.core)."""
    return _compute_setting(weights_input(wildcards))


def weight_files_input(wildcards):
    """The files of the weights directory that make the model (eagledata.extract.weights.model_files,
    what its model_fingerprint reads; not the tokenizer's or generation_config.json): a directory input
    alone is judged by the directory's own mtime, which a weight file rewritten in place does not
    change. A directory a rule builds (the demo model) is judged as that rule's output."""
    return _model_files(weights_input(wildcards))


def weight_files_version(wildcards):
    """The model files (weight_files_input) by name, size and mtime, hashed: a param of the extraction rules.
    Snakemake's mtime trigger reruns a job only for an input NEWER than its outputs, so weights replaced
    by other weights whose files are older (cp -a or rsync -a of another checkpoint, a symlink moved to
    one) reran nothing and the old model's hidden states stayed published. A changed version reruns the
    jobs; the model's fingerprint (a resume key) then decides: the same content is kept, other content
    extracted. Size and mtime only (rsync's quick check): nothing is read, and a copy that keeps mtimes
    (cp -a of the work directory) is the same version. A directory built by a job (the demo model): none."""
    return _weight_files_version(weights_input(wildcards))


# What a weights directory says, read once per Snakemake process (every shard job's params and inputs ask)
@functools.cache
def _layers_setting(weights):
    return layers_setting(config["extraction"]["layers"], weights, built=_built(weights))


@functools.cache
def _compute_setting(weights):
    ext = config["extraction"]
    return compute_setting(ext["compute_dtype"], ext["backend"], weights, built=_built(weights))


@functools.cache
def _model_files(weights):
    return [] if _built(weights) else [str(p) for p in model_files(weights)]


@functools.cache
def _weight_files_version(weights):
    stats = [[Path(f).name, st.st_size, st.st_mtime_ns] for f in _model_files(weights) for st in [os.stat(f)]]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16] if stats else ""


def dataset_targets(name):
    # tokens/ too: a gather interrupted after Snakemake removed its directory() output leaves it
    # missing, and a missing intermediate alone (validation.json up to date) reruns nothing
    targets = [f"{RESULTS}/{name}/tokens", f"{RESULTS}/{name}/validation.json"]
    model = config["models"][config["datasets"][name]["model"]]
    if config["extraction"]["enabled"] and model.get("weights"):
        targets.append(f"{RESULTS}/{name}/hidden")
    return targets


def all_targets():
    return [t for name in DATASETS for t in dataset_targets(name)]


_clashes = set(DATASETS) & {"all", "generate", "import_responses", "tokens", "validate", "extract",
                             "token_plan", "token_shard",
                             "demo_tokenizer", "demo_model", "report", "report_dataset", "export"}
if _clashes:
    raise ValueError(f"config: dataset name(s) {sorted(_clashes)} clash with rule names; rename them")


wildcard_constraints:
    dataset=regex_of(DATASETS),
    shard="[0-9a-f]{16}",
    content="[0-9a-f]{16}",


# The tokens stage's per-shard work (rules/tokens.smk, eagledata.tokens.pershard).
TOKENS_WORK = f"{RESULTS}/{{dataset}}/tokens.work"


def token_shard_keys(wildcards):
    """The shard keys of the dataset's plan (the checkpoint token_plan's output)."""
    plan = checkpoints.token_plan.get(dataset=wildcards.dataset).output.plan
    return plan_keys(plan)


def token_shard_priority(wildcards):
    """A shard job's priority: its shard's rows, so that the larger shards start first and no large one is
    left to run alone while the other cores wait (the sizes vary: up to 4 x tokens.shard_size rows)."""
    return plan_shard_rows(f"{TOKENS_WORK.format(dataset=wildcards.dataset)}/plan.json", wildcards.shard)


def token_summaries(wildcards):
    work = TOKENS_WORK.format(dataset=wildcards.dataset)
    return [f"{work}/parts/{k}.summary.json" for k in token_shard_keys(wildcards)]


def token_plan_threads(wildcards, input):
    """token_plan's processes, by the responses' size (eagledata.tokens.planfile.plan_processes), at
    most 8 and --cores; 1 while the responses do not exist yet (made earlier in this run)."""
    try:
        size = Path(input.responses).stat().st_size
    except OSError:
        return 1
    return plan_processes(size, min(8, workflow.cores))


def token_parts(wildcards):
    work = TOKENS_WORK.format(dataset=wildcards.dataset)
    return [f"{work}/parts/{k}.parquet" for k in token_shard_keys(wildcards)]


def _validation_setting(wildcards, key):
    return canonical(validation_setting(config, wildcards.dataset, key))


def dataset_policy(wildcards):
    return _validation_setting(wildcards, "policy")


def dataset_max_bad_fraction(wildcards):
    return _validation_setting(wildcards, "max_bad_fraction")


def dataset_bad_counts(wildcards):
    return _validation_setting(wildcards, "bad_counts")


def export_targets(name):
    """Trainer exports of dataset `name` (config export.specforge / export.speculators), only
    where its hidden states are a target. rules/export.smk builds them."""
    if f"{RESULTS}/{name}/hidden" not in dataset_targets(name):
        return []
    return [f"{RESULTS}/{name}/export/{kind}" for kind in ("specforge", "speculators") if config["export"][kind]]


def export_all_targets():
    return [t for name in DATASETS for t in export_targets(name)]


generate_inputs = GenerateRuleInputs(config, tokenizer_input)


def generate_tokenizer(wildcards):
    """Where the tokenizer shapes the responses (stand-in, SGLang's native endpoint), its files: a
    change reruns. Elsewhere it only has to exist for the preflight: ``ancient``, so a rebuilt
    tokenizer (e.g. the demo's, after a code change) never re-sends a paid request."""
    shaped = generate_inputs.tokenizer(wildcards)
    if shaped:
        return shaped
    files = tokenizer_input(wildcards)
    return [ancient(f) for f in ([files] if isinstance(files, str) else files)]


# Extraction's per-shard input functions (rules/extract.smk, eagledata.extract.pershard): the checkpoint
# extract_plan maps each stable shard key to its content-named token shard.
from eagledata.extract.plan import plan_sources, read_plan, shard_length_limit


def extract_plan_sources(wildcards):
    plan = checkpoints.extract_plan.get(dataset=wildcards.dataset).output.plan
    return plan_sources(plan)


def extract_shard_source(wildcards):
    """The token shard (in tokens.store, content-named) the job of shard key `wildcards.shard` extracts."""
    return extract_plan_sources(wildcards)[wildcards.shard]


def extract_shard_limit(wildcards):
    """The dataset's length limit (LENGTH_LIMITS, rules/extract.smk) as it acts on shard `wildcards.shard`:
    none when its longest train sample fits, so a limit that acts on no sample of a shard, added,
    raised or removed, reruns none of its job (its stored hidden shard's resume key counts it so too)."""
    plan = checkpoints.extract_plan.get(dataset=wildcards.dataset).output.plan
    return shard_length_limit(plan, wildcards.shard, LENGTH_LIMITS[wildcards.dataset])


def extract_shard_records(wildcards):
    """Every shard job's record, in plan order: the gather's inputs. A record is named by its key and
    the first 16 hex digits of its token shard's sha256 (``{key}/{content}.json``): changed tokens have
    no record yet, so their job runs in the run that rewrote the plan (a record named by the key alone
    existed, and Snakemake, planning the shard jobs before the plan's rewrite, left them unrun). Here,
    not in eagledata.extract (whose modules are the shard jobs' code, a resume key of every hidden shard)."""
    plan = checkpoints.extract_plan.get(dataset=wildcards.dataset).output.plan
    work = f"{RESULTS}/{wildcards.dataset}/hidden.work/shards"
    return [f"{work}/{s['key']}/{s['sha256'][:16]}.json" for s in read_plan(plan)["shards"]]
