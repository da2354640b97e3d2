"""Snakemake entry for rule extract: token shards -> hidden-state shards (HF or SGLang backend).

Plumbing only; the logic is eagledata.extract.core. Settings come from config["extraction"]. GPUs are
claimed (flock, eagledata.extract.gpus) and CUDA_VISIBLE_DEVICES set BEFORE torch is imported. Shards are
written to an undeclared sibling work directory and renamed onto the declared output at the end,
so a failed or killed job's finished shards survive Snakemake's cleanup and the next try resumes.
"""

import logging
from pathlib import Path

from eagledata.extract import gpus

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.extract")

try:
    cfg = dict(smk.config.get("extraction") or {})
    device = str(cfg.get("device", "auto"))
    n_gpus = int(smk.resources.get("gpu", cfg.get("gpus_per_job", 1)))
    if device != "cpu" and n_gpus > 0:
        ids = gpus.claim_gpus(n_gpus, cfg.get("gpu_lock_dir"))  # sets CUDA_VISIBLE_DEVICES; torch not imported yet
        log.info("job pinned to GPUs %s", ids)

    import torch  # noqa: E402  (after the claim, on purpose)

    from eagledata.extract import core as ex  # noqa: E402
    from eagledata.extract.base import ExtractionError  # noqa: E402
    from eagledata.extract.hf import resolve_device  # noqa: E402

    if not cfg.get("enabled", True):
        raise ExtractionError("extraction.enabled is false in the config, but rule extract was requested")
    if resolve_device(device) == "cpu":
        torch.set_num_threads(max(1, int(smk.threads)))

    out = Path(smk.output[0])
    own = dict(smk.config["datasets"][smk.wildcards.dataset].get("extraction") or {})  # length limit
    backend = str(cfg.get("backend", "hf"))
    options = {}
    if backend == "sglang":
        options = {"mem_fraction_static": float(cfg.get("sglang_mem_fraction", 0.85)),
                   "server_args": dict(cfg.get("sglang_server_args") or {})}
    ex.extract_dataset(
        tokens_dir=smk.input.tokens,
        out_dir=out,
        weights=smk.input.weights,
        layers=cfg.get("layers"),
        dtype=str(cfg.get("dtype", "bfloat16")),
        device=device,
        batch_tokens=int(cfg.get("batch_tokens", 8192)),
        compute_dtype=str(cfg.get("compute_dtype", "auto")),
        backend=backend,
        backend_options=options,
        reserve_disk_bytes=int(cfg.get("reserve_disk_gb", 0) * (1 << 30)),
        work_dir=out.parent / f".{out.name}.partial",
        final_norm=cfg.get("final_norm"),  # removed setting: refused with a message when set
        max_seq_len=own.get("max_seq_len"),
        on_long=str(own.get("on_long", "truncate")),
    )
except Exception:
    log.exception("extraction failed")
    raise
