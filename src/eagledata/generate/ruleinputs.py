"""The named input and params functions of ``rules/generate.smk``, bound to the workflow's config
(kept in the package because ``snakemake --lint`` wants no functions beside rules)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from eagledata.config import DatasetSettings, dataset_settings
from eagledata.generate.requests import request_params, tokenizer_shapes_responses
from eagledata.generate.retryfinal import retry_note_path


class GenerateRuleInputs:
    """The named input and params functions of ``rules/generate.smk``, bound to the workflow's
    config (kept here because ``snakemake --lint`` wants no functions beside rules)."""

    def __init__(self, config: Mapping[str, Any], tokenizer_input: Callable[[Any], Any]):
        self.config = config
        self.tokenizer_input = tokenizer_input

    def settings(self, wildcards: Any) -> DatasetSettings:
        return dataset_settings(self.config, wildcards.dataset)

    def prompts(self, wildcards: Any) -> list[str]:
        """The dataset's own prompt file. The prompt files of the datasets it is deduplicated against
        are read by the job, not declared: editing an earlier dataset never reruns this one (its
        answers stand; the job's next run leaves out whatever has become a duplicate)."""
        return [self.settings(wildcards).prompts]

    def tokenizer(self, wildcards: Any) -> Any:
        """The simulator answers with the model's tokenizer, and SGLang's native endpoint is sent
        prompt ids from it, so its files shape the responses there (dedup compares prompt ids too,
        but a rebuilt tokenizer that merges no other prompts should not rerun the job)."""
        return self.tokenizer_input(wildcards) if tokenizer_shapes_responses(self.settings(wildcards)) else []

    def request(self, wildcards: Any) -> dict[str, Any]:
        """Output-shaping settings (see :func:`request_params`)."""
        return request_params(self.settings(wildcards), self.config)

    def retried(self, wildcards: Any) -> list[str]:
        """The dataset's retry note where ``eagledata retry`` wrote one (:mod:`eagledata.generate.retryfinal`):
        written after the job's last run, it is newer than the outputs, so the job reruns and requests
        the final errors the command forgot."""
        path = retry_note_path(self.config["cache_dir"], wildcards.dataset)
        return [str(path)] if path.exists() else []

    def imported(self, wildcards: Any) -> str:
        return self.settings(wildcards).responses

