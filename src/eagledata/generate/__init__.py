"""The generate stage: prompts -> exact response bodies (OpenRouter, SGLang or the stand-in).

One module per concept: :mod:`~eagledata.generate.job` (the entry, :func:`generate_dataset`, in steps),
:mod:`~eagledata.generate.requests` (request bodies and cache keys), :mod:`~eagledata.generate.cache`
(the response cache), :mod:`~eagledata.generate.attempts` (workers and retries),
:mod:`~eagledata.generate.transport` (HTTP through httpx), :mod:`~eagledata.generate.answers` (what an
answer means), :mod:`~eagledata.generate.retries` (backoff, Retry-After),
:mod:`~eagledata.generate.openrouter` (reconciliation endpoints), :mod:`~eagledata.generate.budget`
(the ledger), :mod:`~eagledata.generate.plan` (prices, worst cases, ``eagledata plan``),
:mod:`~eagledata.generate.preflight`, :mod:`~eagledata.generate.imports` (``responses:`` datasets),
:mod:`~eagledata.generate.ruleinputs` (the rule's input functions) and the smaller helpers.
"""
