"""Exports of the hidden states into trainers' own file layouts.

* :mod:`~eagledata.export.trainers`: the registry of exporters (trainer name -> function);
* :mod:`~eagledata.export.specforge`: SpecForge's offline ``*.ckpt`` layout;
* :mod:`~eagledata.export.speculators`: vLLM speculators' ``hs_{i}.safetensors`` layout;
* :mod:`~eagledata.export.common`: reading samples back, the resumable work directory, metadata.

torch is imported inside the export functions only.
"""
