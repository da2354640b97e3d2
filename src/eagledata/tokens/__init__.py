"""Tokens stage: a responses file -> exact token ids and verdicts in stable Parquet shards.

``responses`` parses raw bodies, ``reconstruct`` and ``samples`` rebuild each sample's ids,
``checks``, ``learning``, ``repairs`` and ``policy`` judge them against the billed counts, and
``shards`` writes the content-defined, id-stable shards and their manifest."""
