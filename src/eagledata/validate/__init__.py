"""Validation stage: a dataset's per-sample verdicts gathered into ``validation.json`` and a readable
summary, with the gate that blocks extraction (``summary``), and provider fidelity profiles
accumulated over runs (``profiles``)."""
