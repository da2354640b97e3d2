"""The local OpenRouter / SGLang stand-in: the demo backend, and a way to rehearse a run with faults.

Modules, one concept each:

* :mod:`~eagledata.standin.corpus`: sentences and words of the bundled corpus (the text source);
* :mod:`~eagledata.standin.model`: :class:`CompletionModel`, completions as token ids first (the truth);
* :mod:`~eagledata.standin.profiles`: provider profiles: decoding ids into a response, and the quirks
  (hooks) of each provider and of its served model (:data:`PROFILES`);
* :mod:`~eagledata.standin.faults`: injected failures (:class:`Fault`) and error bodies;
* :mod:`~eagledata.standin.responses`: one answer (:class:`Generation`) and its bodies in OpenRouter's
  JSON / SSE and SGLang's shapes;
* :mod:`~eagledata.standin.server`: :class:`SimulatorServer`, the HTTP server (routes, counters,
  billing, the asyncio protocol);
* :mod:`~eagledata.standin.cli`: ``python -m eagledata.standin`` (also ``python -m eagledata.standin.server``).

Nothing is imported here: ``from eagledata.standin.server import SimulatorServer``.
"""
