"""Hidden-state extraction: token shards -> EAGLE-3 training tensors (token-major safetensors).

* :mod:`~eagledata.extract.core`: batches, one shard, the dataset in one process with resume
  (:func:`~eagledata.extract.core.extract_dataset`; the layer and file conventions are in its docstring);
* :mod:`~eagledata.extract.pershard`: the workflow's jobs: one shard per job into the store
  (:func:`~eagledata.extract.pershard.extract_keyed_shard`), and the gather into ``hidden/``;
* :mod:`~eagledata.extract.plan`: the extraction plan (stable shard key -> content-named token shard);
* :mod:`~eagledata.extract.layers`: layer semantics ("output of decoder layer i"), defaults, checks;
* :mod:`~eagledata.extract.storage`: token shards in, streamed safetensors shards out, manifest,
  index, resume metadata, the disk-space check;
* :mod:`~eagledata.extract.base`: the backend base class, the error class, allowed settings;
* :mod:`~eagledata.extract.hf`: the Hugging Face backend (forward hooks, no LM head);
* :mod:`~eagledata.extract.sglang`: the SGLang backend (model runner in-process, tensor parallel);
* :mod:`~eagledata.extract.gpus`: GPU claims (flock per device; sets ``CUDA_VISIBLE_DEVICES``).

No module imports torch, transformers or sglang at import time, so :mod:`~eagledata.extract.gpus`
can pin the job's devices before CUDA is initialised.
"""
