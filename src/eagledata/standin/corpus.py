"""The stand-in's text source: sentences and words of the bundled corpus (``eagledata/data/corpus.txt``),
from which :class:`eagledata.standin.model.CompletionModel` draws reasoning, content and argument text."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=4)
def corpus_sentences(text: str | None = None) -> tuple[tuple[str, int], ...]:
    """Sentences of the corpus as (text, paragraph number), in corpus order."""
    if text is None:
        text = resources.files("eagledata").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    out: list[tuple[str, int]] = []
    for p, para in enumerate(re.split(r"\n\s*\n", text)):
        for sentence in re.split(r"(?<=[.!?])\s+", para.strip()):
            if sentence and len(sentence) <= 300:
                out.append((sentence, p))
    if not out:
        raise ValueError("simulator corpus has no sentences")
    return tuple(out)


@lru_cache(maxsize=4)
def corpus_words(text: str | None = None) -> tuple[str, ...]:
    """Distinct words (3 to 12 letters) of the corpus, sorted: tool-argument strings are drawn from them."""
    words = {w for s, _ in corpus_sentences(text) for w in re.findall(r"[A-Za-z]{3,12}", s)}
    return tuple(sorted(words))
