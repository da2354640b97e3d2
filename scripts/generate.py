"""Snakemake entry for rule `generate` (plumbing only; logic in eagledata.generate)."""
import json
import sys

from eagledata.generate import GenerationError, generate_dataset

sm = snakemake  # noqa: F821 - injected by Snakemake
with open(sm.log[0], "a", encoding="utf-8") as log_fh:

    def log(message: str) -> None:
        log_fh.write(message + "\n")
        log_fh.flush()

    try:
        summary = generate_dataset(sm.config, sm.wildcards.dataset, sm.output[0], log=log)
        log("summary: " + json.dumps(summary))
    except GenerationError as exc:  # expected stops (failing prompts, 401/402, budget): message only
        log(f"ERROR: {exc}")
        print(f"generate {sm.wildcards.dataset}: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        import traceback

        log(traceback.format_exc())
        raise
