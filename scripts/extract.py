"""Snakemake entry for rule extract: token shards -> hidden-state shards (HF backend).

Plumbing only; the logic is eagledata.extract. Settings come from config["extraction"]; GPUs are
claimed (flock) and CUDA_VISIBLE_DEVICES set BEFORE torch is imported (eagledata.extract imports
torch lazily). Shards are written to an undeclared sibling work directory and renamed onto the
declared output at the end, so a failed job's finished shards survive Snakemake's cleanup and the
next try resumes from them.
"""

import logging
from pathlib import Path

from eagledata import extract as ex

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.extract")

try:
    cfg = dict(smk.config.get("extraction") or {})
    if not cfg.get("enabled", True):
        raise ex.ExtractionError("extraction.enabled is false in the config, but rule extract was requested")
    device = str(cfg.get("device", "auto"))
    gpus = int(cfg.get("gpus_per_job", 1))
    if device != "cpu" and gpus > 0:
        ex.claim_gpus(gpus)

    import torch

    if ex.resolve_device(device) == "cpu":
        torch.set_num_threads(max(1, int(smk.threads)))

    out = Path(smk.output[0])
    ex.extract_dataset(
        tokens_dir=smk.input.tokens,
        out_dir=out,
        weights=smk.input.weights,
        layers=cfg.get("layers"),
        final_norm=str(cfg.get("final_norm", "after")),
        dtype=str(cfg.get("dtype", "bfloat16")),
        device=device,
        batch_tokens=int(cfg.get("batch_tokens", 8192)),
        work_dir=out.parent / f".{out.name}.partial",
    )
except Exception:
    log.exception("extraction failed")
    raise
