"""Snakemake entry for rule extract_shard: one token shard -> its hidden-state shard in the store (HF or
SGLang backend). Plumbing only; the logic is eagledata.extract.pershard.

GPUs are claimed (flock, eagledata.extract.gpus) and CUDA_VISIBLE_DEVICES set BEFORE torch is imported;
the claimed devices and the claim time go into the shard's record.
"""

import logging
import time

from eagledata.extract import gpus

smk = snakemake  # noqa: F821  (injected by Snakemake)
logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("eagledata.scripts.extract_shard")

try:
    cfg = dict(smk.config.get("extraction") or {})
    device = str(cfg.get("device", "auto"))
    n_gpus = int(smk.resources.get("gpu", cfg.get("gpus_per_job", 1)))
    job = {"gpus": [], "claimed": None}
    if device != "cpu" and n_gpus > 0:
        job["gpus"] = gpus.claim_gpus(n_gpus, cfg.get("gpu_lock_dir"))  # sets CUDA_VISIBLE_DEVICES; no torch yet
        job["claimed"] = time.time()
        log.info("job pinned to GPUs %s", job["gpus"])

    import torch  # noqa: E402  (after the claim, on purpose)

    from eagledata.extract.base import ExtractionError  # noqa: E402
    from eagledata.extract.hf import resolve_device  # noqa: E402
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard  # noqa: E402

    if not cfg.get("enabled", True):
        raise ExtractionError("extraction.enabled is false in the config, but rule extract_shard was requested")
    if resolve_device(device) == "cpu":
        torch.set_num_threads(max(1, int(smk.threads)))
    settings = ExtractionSettings.from_config(smk.config, smk.wildcards.dataset, smk.input.weights, smk.input.code)
    from eagledata.codeinputs import verify_loaded_code  # noqa: E402

    verify_loaded_code(smk.input.code, children=True)  # the code imported is the code stamped (again before publishing)
    record = extract_keyed_shard(smk.params.plan, smk.wildcards.shard, smk.input.tokens, smk.params.store,
                                 smk.output[0], settings, job=job, verify=lambda: verify_loaded_code(smk.input.code))
    log.info("shard %s -> %s (%s)", smk.wildcards.shard, record["file"],
             "kept from the store" if record["resumed"] else "extracted")
except Exception:
    log.exception("extract_shard failed")
    raise
