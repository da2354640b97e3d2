"""The embedded demo's tokenizer: a small byte-level BPE in Kimi's layout.

The demo must run without the real Kimi vocabulary, so it trains a byte-level BPE on the bundled
corpus (``data/corpus.txt``) with Kimi's pre-tokenization pattern and writes a tiktoken directory
(``tiktoken.model``, ``tokenizer_config.json``, ``pattern.txt``, ``chat_template.jinja``) whose special
tokens carry Kimi's names at Kimi's offsets from the first special id, with Kimi's ``special`` flags.
Everything downstream (self-check, chat rendering, segment-wise encoding) then exercises the same
code paths as with the real Kimi K2.5 tokenizer, only with a 2,048-token vocabulary.

tiktoken compatibility. tiktoken does not replay a list of learned pairs: inside each pre-tokenized
piece it merges the adjacent pair whose *concatenated bytes* have the lowest rank, and returns a piece
that is itself a token directly. A classic pair-list trainer can therefore produce ranks that tiktoken
applies differently. :func:`train_byte_bpe` trains with tiktoken's rule itself (each corpus chunk's
split is, at every step, what tiktoken would produce with the ranks so far), so tiktoken's encoding
with the returned ranks equals the trainer's splits; :func:`bpe_encode` is the same rule in pure
Python, for tests.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import logging
import time
from collections import Counter, defaultdict
from functools import lru_cache
from importlib import resources
from pathlib import Path

from eagledata.io import atomic_write_text
from eagledata.text.families import KIMI_PATTERN

log = logging.getLogger(__name__)

#: Total vocabulary of the demo tokenizer (BPE ranks + 256 special ids).
DEMO_VOCAB_SIZE = 2048
#: Number of ids above the ranks reserved for special tokens (as in Kimi K2.5).
SPECIAL_RANGE = 256
DEFAULT_N_RANKS = DEMO_VOCAB_SIZE - SPECIAL_RANGE  # 1792

#: Kimi K2.5's named special tokens: (name, offset from the first special id, ``special`` flag).
#: Copied from Kimi K2.5's tokenizer_config.json ``added_tokens_decoder`` (first special id
#: 163584 = ``[BOS]``). Unnamed offsets are reserved tokens, as in Kimi.
KIMI_SPECIAL_TOKENS: tuple[tuple[str, int, bool], ...] = (
    ("[BOS]", 0, True),
    ("[EOS]", 1, True),
    ("<|im_end|>", 2, True),
    ("<|im_user|>", 3, True),
    ("<|im_assistant|>", 4, True),
    ("<|start_header_id|>", 6, True),
    ("<|end_header_id|>", 7, True),
    ("[EOT]", 9, True),
    ("<|im_system|>", 10, True),
    ("<|tool_calls_section_begin|>", 11, False),
    ("<|tool_calls_section_end|>", 12, False),
    ("<|tool_call_begin|>", 13, False),
    ("<|tool_call_argument_begin|>", 14, False),
    ("<|tool_call_end|>", 15, False),
    ("<|im_middle|>", 17, True),
    ("<|media_begin|>", 18, True),
    ("<|media_content|>", 19, True),
    ("<|media_end|>", 20, True),
    ("<|media_pad|>", 21, True),
    ("<think>", 22, False),
    ("</think>", 23, False),
    ("[UNK]", 254, True),
    ("[PAD]", 255, True),
)

#: Kimi K2.5's ``additional_special_tokens`` list.
KIMI_ADDITIONAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
    "<|im_system|>", "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
)

TEMPLATE_RESOURCE = "kimi-k2.5.jinja"


def default_corpus_path() -> Path:
    """Path of the bundled training corpus (``eagledata/data/corpus.txt``)."""
    return Path(str(resources.files("eagledata") / "data" / "corpus.txt"))


def kimi_k25_chat_template() -> str:
    """The vendored Kimi K2.5 chat template (``eagledata/data/templates/kimi-k2.5.jinja``)."""
    return (resources.files("eagledata") / "data" / "templates" / TEMPLATE_RESOURCE).read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def compile_pattern(pattern: str):
    """Compile a tiktoken ``pat_str`` with the ``regex`` module. VERSION1 is needed for the
    character-class intersection (``&&``) Kimi's pattern uses; it is harmless otherwise."""
    import regex

    return regex.compile(pattern, flags=regex.V1)


def pretokenize(text: str, pattern: str) -> list[str]:
    return compile_pattern(pattern).findall(text)


# --------------------------------------------------------------------------------------------
# training


def train(text: str, n_merges: int, pattern: str) -> tuple[dict[bytes, int], dict[bytes, list[int]]]:
    """Train; return (ranks, final split of every distinct corpus chunk as ranks).

    Splits are kept equal to tiktoken's encoding under the ranks learned so far: a chunk that is a
    token is that token; otherwise the adjacent pair whose concatenation has the lowest rank is
    merged, leftmost first, until none is a token. A new token always gets the highest rank, so
    adding it only continues the merging of the chunks where it occurs (from their current split).
    Candidates are counted by concatenated bytes: different pairs spelling the same bytes
    (``" a"+"n"``, ``" "+"an"``) produce the same token.
    """
    if n_merges < 0:
        raise ValueError("n_merges must be >= 0")
    chunk_counts = Counter(c.encode("utf-8") for c in pretokenize(text, pattern))
    chunks = sorted(chunk_counts)  # deterministic order, independent of hash seeds
    chunk_index = {c: i for i, c in enumerate(chunks)}
    words: list[list[int]] = [list(c) for c in chunks]
    freqs: list[int] = [chunk_counts[c] for c in chunks]

    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    ranks: dict[bytes, int] = {b: i for i, b in enumerate(vocab)}

    counts: dict[bytes, int] = defaultdict(int)  # concatenation of an adjacent pair -> weighted count
    where: dict[bytes, set[int]] = defaultdict(set)  # concatenation -> chunks that (may) contain it
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for x, y in zip(w, w[1:]):
            cat = vocab[x] + vocab[y]
            counts[cat] += f
            where[cat].add(wi)
    # ties between equally frequent candidates go to the smaller byte string: deterministic
    heap = [(-c, cat) for cat, c in counts.items()]
    heapq.heapify(heap)

    while len(vocab) - 256 < n_merges:
        best = None
        while heap:
            negc, cat = heapq.heappop(heap)
            if counts.get(cat, 0) == -negc:
                best = cat
                break
        if best is None:
            raise ValueError(f"corpus too small: only {len(vocab) - 256} merges possible, {n_merges} requested")
        new_id = len(vocab)
        vocab.append(best)
        ranks[best] = new_id

        affected = where.pop(best, set())
        if best in chunk_index:  # tiktoken returns a piece that is a token as that token
            affected.add(chunk_index[best])
        changed: set[bytes] = set()
        for wi in sorted(affected):
            w, f = words[wi], freqs[wi]
            for x, y in zip(w, w[1:]):
                cat = vocab[x] + vocab[y]
                counts[cat] -= f
                changed.add(cat)
            merged = [new_id] if chunks[wi] == best else merge_to_end(w, vocab, ranks)
            words[wi] = merged
            for x, y in zip(merged, merged[1:]):
                cat = vocab[x] + vocab[y]
                counts[cat] += f
                where[cat].add(wi)
                changed.add(cat)
        for cat in sorted(changed):
            c = counts[cat]
            if c > 0:
                heapq.heappush(heap, (-c, cat))
            else:
                del counts[cat]
                where.pop(cat, None)
        counts.pop(best, None)

    return ranks, {chunk: w for chunk, w in zip(chunks, words)}


def merge_to_end(ids: list[int], vocab: list[bytes], ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's merge loop from the split ``ids``: merge the leftmost adjacent pair whose
    concatenation has the lowest rank until no concatenation is a token."""
    parts = [vocab[i] for i in ids]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank, best_i = r, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


def train_byte_bpe(text: str, n_merges: int, pattern: str) -> dict[bytes, int]:
    """Byte-level BPE ranks: 0..255 are the single bytes, then one rank per merge in order.

    ``text`` is pre-tokenized with ``pattern`` (tiktoken syntax) and training runs on the counts of
    distinct chunks with incremental count updates, merging with tiktoken's own rule (see
    :func:`train`), so tiktoken's encoding with the result equals the trainer's splits. Ties between
    equally frequent candidates go to the smaller byte string: the result depends on ``text`` only.
    """
    return train(text, n_merges, pattern)[0]


def bpe_encode(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """The trainer's merge application in pure Python, independent of tiktoken: pre-tokenize with
    ``regex``; a chunk that is a token is that token, else merge from single bytes by lowest rank."""
    vocab = [b""] * len(ranks)
    for tok, r in ranks.items():
        vocab[r] = tok
    cache: dict[str, list[int]] = {}
    out: list[int] = []
    for chunk in pretokenize(text, pattern):
        ids = cache.get(chunk)
        if ids is None:
            raw = chunk.encode("utf-8")
            ids = cache[chunk] = [ranks[raw]] if raw in ranks else merge_to_end(list(raw), vocab, ranks)
        out.extend(ids)
    return out


# --------------------------------------------------------------------------------------------
# the tokenizer directory


def special_tokens(first_id: int) -> dict[str, int]:
    """Kimi's special-token names placed at Kimi's offsets from ``first_id``."""
    return {name: first_id + off for name, off, _ in KIMI_SPECIAL_TOKENS}


def tokenizer_config(n_ranks: int) -> dict:
    decoder = {
        str(n_ranks + off): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": flag,
        }
        for name, off, flag in KIMI_SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(KIMI_ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "tokenizer_class": "TikTokenTokenizer",
        "vocab_size": n_ranks + SPECIAL_RANGE,
    }


def _demo_md(n_ranks: int, corpus_name: str, corpus_sha: str) -> str:
    return f"""# Demo tokenizer (not Kimi's vocabulary)

A small byte-level BPE built by `eagledata.demo.tokenizer.build_demo_tokenizer` for the embedded
demo. It is laid out like Kimi K2.5's tokenizer so that every code path of the pipeline runs on it:

- `tiktoken.model`: {n_ranks} BPE ranks (`base64(bytes) rank`; 0..255 are the single bytes, then
  {n_ranks - 256} merges) trained on `{corpus_name}` (sha256 {corpus_sha}) with Kimi's
  pre-tokenization pattern (`pattern.txt`).
- `tokenizer_config.json`: Kimi K2.5's special-token names at Kimi's offsets from the first special
  id ({n_ranks} here, 163584 in Kimi), with Kimi's `special` flags; {SPECIAL_RANGE} special ids, vocabulary
  {n_ranks + SPECIAL_RANGE}.
- `chat_template.jinja`: the Kimi K2.5 chat template, unchanged.

Token ids here mean nothing for a real Kimi model. Rebuilding from the same corpus gives
byte-identical files.
"""


def build_demo_tokenizer(corpus_path: str | Path | None, out_dir: str | Path,
                         n_ranks: int = DEFAULT_N_RANKS) -> Path:
    """Train on ``corpus_path`` (default: the bundled corpus) and write the tokenizer directory
    ``out_dir``. Deterministic: the same corpus gives byte-identical files."""

    if n_ranks < 256:
        raise ValueError("n_ranks must be at least 256 (the single bytes)")
    corpus_path = Path(corpus_path) if corpus_path else default_corpus_path()
    raw = corpus_path.read_bytes()
    text = raw.decode("utf-8")
    t0 = time.perf_counter()
    ranks = train_byte_bpe(text, n_ranks - 256, KIMI_PATTERN)
    elapsed = time.perf_counter() - t0
    log.info("trained %d ranks on %s (%d bytes) in %.2f s", len(ranks), corpus_path, len(raw), elapsed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {r}\n" for tok, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    atomic_write_text(out / "tiktoken.model", "".join(lines))
    atomic_write_text(out / "tokenizer_config.json", json.dumps(tokenizer_config(n_ranks), indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out / "pattern.txt", KIMI_PATTERN + "\n")
    atomic_write_text(out / "chat_template.jinja", kimi_k25_chat_template())
    atomic_write_text(out / "DEMO.md", _demo_md(n_ranks, corpus_path.name, hashlib.sha256(raw).hexdigest()))
    log.info("wrote %s (vocabulary %d)", out, n_ranks + SPECIAL_RANGE)
    return out
