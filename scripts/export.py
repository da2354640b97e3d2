"""Snakemake entry for rule export (results/{dataset}/export/{kind}): hidden-state shards -> a
trainer's own file layout (eagledata.export.trainers). Trainer files are written per hidden shard into
the undeclared sibling store ({out}.store, kept across runs: unchanged shards are not rewritten); the
layout is assembled in an undeclared sibling work directory and renamed onto the declared output."""

import logging
from pathlib import Path

from eagledata.codeinputs import verify_loaded_code
from eagledata.export import trainers as export
from eagledata.io import sha256_file

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.export")

try:
    verify_loaded_code(smk.input.code)  # the code imported is the code stamped (and again at the end)
    out = Path(smk.output[0])
    kind = smk.params.kind
    # the code stamp's digest keys the store's entries: files older code wrote are not reused
    kwargs = {"dtype": str(smk.params.dtype), "draft_vocab_size": int(smk.params.draft_vocab_size),
              "code_version": sha256_file(smk.input.code[0]),
              "keep_replaced_bytes": int(float(smk.params.keep_replaced_gb) * (1 << 30))}
    if kind == "specforge":
        kwargs["group_size"] = int(smk.params.group_size)
    export.EXPORTERS[kind](smk.input.hidden, out, work_dir=out.parent / f".{out.name}.partial",
                           store_dir=out.parent / f"{out.name}.store", **kwargs)
    verify_loaded_code(smk.input.code)
except Exception:
    log.exception("export failed")
    raise
