"""Snakemake entry for rules export_specforge / export_speculators: hidden-state shards -> a
trainer's own file layout (eagledata.export.trainers). Written to an undeclared sibling work directory and
renamed onto the declared output at the end (a failed job's files survive for the next try)."""

import logging
from pathlib import Path

from eagledata.export import trainers as export

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.export")

try:
    out = Path(smk.output[0])
    kind = smk.params.kind
    kwargs = {"group_size": int(smk.params.group_size)} if kind == "specforge" else {}
    export.EXPORTERS[kind](smk.input.hidden, out, work_dir=out.parent / f".{out.name}.partial", **kwargs)
except Exception:
    log.exception("export failed")
    raise
