"""The embedded demo's artifacts, built from bundled data so the pipeline runs with no download.

* :mod:`~eagledata.demo.tokenizer`: a small byte-level BPE in Kimi K2.5's tokenizer layout, trained on
  the bundled corpus (``build_demo_tokenizer``);
* :mod:`~eagledata.demo.model`: a tiny random ``DeepseekV3ForCausalLM`` for extraction (``build_demo_model``;
  imports torch and transformers inside the function only).
"""
