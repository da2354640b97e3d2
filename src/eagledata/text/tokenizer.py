"""Tokenizers with exact plain-text encoding, special ids by name, and a load-time self-check.

Three sources are supported (see :func:`load_tokenizer`):

* a tiktoken directory (``tiktoken.model``, ``tokenizer_config.json``, ``pattern.txt``, optional
  ``chat_template.jinja``), as in ``shared/tokenizers/kimi-k2.5``;
* a published Kimi model directory (``tiktoken.model``, ``tokenizer_config.json``,
  ``tokenization_kimi.py``, chat template): loaded from its data files with the family's known
  pattern, never executing the shipped code (it fails on transformers >= 5);
* any Hugging Face tokenizer directory or hub id through ``AutoTokenizer``.

Contract of every tokenizer:

* ``encode_plain(text)`` never turns text into special ids (``"<|im_end|>"`` written by a model
  stays ordinary tokens); for Kimi it equals Kimi's own tokenizer on the same text, including its
  long-input splitting rule.
* ``encode_plain_ahead(texts)`` may encode ``texts`` now, for ``encode_plain`` to hand each out
  once later: a speed-up only (what ``encode_plain`` returns is the same either way).
* ``encode_with_specials(text)`` parses special-token text (used for rendered chat prompts, as
  the model's chat template path does); ``encode_prompt(text)`` returns the same ids for a rendered
  prompt (a tokenizer may keep the encodings of the blocks a dataset's prompts share).
* ``decodes_to(ids, text)`` is exactly ``decode(ids) == text`` (the validation checks' question;
  a tokenizer may answer it without decoding when it can prove the answer).
* ``special_id(name)`` looks ids up by name; nothing in this package types an id in.
* ``fingerprint`` hashes vocabulary, special tokens and chat template (and, for a Hugging Face fast
  tokenizer, its whole definition: merges, normalizer, pre-tokenizer).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import marshal
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

from eagledata.text.families import ModelFamily
from eagledata.errors import EagledataError
from eagledata.io import atomic_write_bytes

TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1))

#: Special tokens of these shapes (``<|name|>``, ``[NAME]`` or ``<name>``, none of ``<>|[]`` inside) are all
#: found by ``findall`` in any text: a match holds no ``<`` or ``[`` but its first character, so none can
#: hide the start of another, and at a special's start the match is that special (the shapes never
#: compete: the second character is ``|`` in the first alone). When every special of a tokenizer has one,
#: the specials a text holds are among the names its matches give, and tiktoken, which parses only the
#: allowed specials it finds (the others stay text), encodes the text the same told of those alone.
SPECIAL_SHAPE = re.compile(r"<\|[^<>|\[\]]+\|>|\[[^<>|\[\]]+\]|<[^<>|\[\]]+>")


class TokenizerError(EagledataError):
    """A tokenizer could not be loaded or failed its self-check (continuing would corrupt ids)."""


class TokenizerSelfCheckError(TokenizerError):
    def __init__(self, name: str, token_id: int | None, problem: str, source: str):
        self.name, self.token_id, self.problem, self.source = name, token_id, problem, source
        super().__init__(f"tokenizer {source}: special token {name!r} (id {token_id}) failed self-check: {problem}")


class Tokenizer(Protocol):
    source: str
    chat_template: str | None
    fingerprint: str
    vocab_size: int
    #: how the model's tokenizer code declares tools to the chat template (the family's setting)
    tool_declaration: str

    def encode_plain(self, text: str) -> list[int]: ...
    def encode_plain_ahead(self, texts: Iterable[str]) -> None: ...
    def encode_with_specials(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decodes_to(self, ids: list[int], text: str) -> bool: ...
    def special_id(self, name: str) -> int: ...
    def is_special_id(self, token_id: int) -> bool: ...
    def special_names(self) -> dict[str, int]: ...


def kimi_keeps_whole(text: str) -> bool:
    """Whether Kimi's tokenizer encodes ``text`` as one piece (:func:`split_for_kimi` cuts it otherwise)."""
    return len(text) <= TIKTOKEN_MAX_ENCODE_CHARS and (
        len(text) <= MAX_NO_WHITESPACES_CHARS or not _LONG_RUN.search(text))


def split_for_kimi(text: str) -> Iterator[str]:
    """Cut ``text`` the way Kimi's tokenizer does before encoding: 400,000-character windows, and
    runs of whitespace or of non-whitespace longer than 25,000 characters split into pieces."""
    if kimi_keeps_whole(text):
        yield text
        return
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from _split_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS)


def _split_runs(s: str, max_len: int) -> Iterator[str]:
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


#: how many recent plain encodings a tiktoken tokenizer keeps for :meth:`TiktokenTokenizer.decodes_to`
RECENT_PLAIN = 64
#: distinct prompt openings (tool declaration and system prompt) a tiktoken tokenizer keeps encoded
#: (:meth:`TiktokenTokenizer.encode_prompt`), and the longest kept: at most about 16 x 64k characters
PROMPT_HEADS_KEPT = 16
PROMPT_HEAD_MAX_CHARS = 65_536
_SYSTEM_BLOCK, _BLOCK_END = "<|im_system|>", "<|im_end|>"


def _remember(recent: dict[str, list[int]], text: str, ids: list[int]) -> None:
    """Keep a copy of ``ids`` (the caller may change its list) as the encoding of ``text``; the
    oldest entry goes when more than :data:`RECENT_PLAIN` are kept."""
    recent[text] = ids[:]
    drop_oldest(recent, RECENT_PLAIN)


def drop_oldest(entries: dict, limit: int) -> None:
    """Remove the oldest entry of ``entries`` (the first inserted) when it holds more than ``limit``: a
    bounded memo. Tolerates another thread doing the same at once."""
    if len(entries) > limit:
        try:
            del entries[next(iter(entries))]
        except (KeyError, StopIteration, RuntimeError):  # another thread got there first
            pass


def _no_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sha256_parts(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def read_tiktoken_ranks(path: Path, data: bytes | None = None) -> dict[bytes, int]:
    """Read a ``base64(bytes) rank`` file (``data``: its bytes, when already read); errors name the
    file and line."""
    try:  # every job loads the tokenizer: one pass over the bytes, base64 decoded as b64decode does
        if data is None:
            data = Path(path).read_bytes()
        return {binascii.a2b_base64(tok): int(rank)
                for tok, rank in (line.split() for line in data.splitlines() if line.strip())}
    except Exception:  # noqa: BLE001 - the line-by-line read below names the offending line
        pass
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
            except Exception as exc:  # noqa: BLE001 - reported with location
                raise TokenizerError(f"{path}:{lineno}: not a 'base64 rank' line ({exc})") from None
    return ranks


def ranks_cache_dir() -> Path | None:
    """Where decoded rank tables are kept between processes: ``$EAGLEDATA_CACHE_DIR`` (empty: no
    cache), else ``$XDG_CACHE_HOME/eagledata``, else ``~/.cache/eagledata``; ``tiktoken-ranks/`` in it."""
    env = os.environ.get("EAGLEDATA_CACHE_DIR")
    if env is not None:
        return Path(env) / "tiktoken-ranks" if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagledata" / "tiktoken-ranks"


def cached_tiktoken_ranks(path: Path, data: bytes, digest: bytes) -> dict[bytes, int]:
    """:func:`read_tiktoken_ranks` of ``path`` (its bytes ``data``, their sha256 ``digest``), through a
    cache every per-shard job shares: decoding 163,840 base64 lines costs a job about 0.15 s more
    than reading the table back with :mod:`marshal` (data only, no code runs on load). An entry is
    named by the sha256 of the rank file and the Python it was written by, and holds the sha256 of
    its own payload: a changed rank file gets another entry, and an entry whose bytes do not check
    (a torn or damaged file) is decoded again and rewritten. A cache that cannot be read or
    written is skipped, never an error."""
    cache = ranks_cache_dir()
    entry = cache / f"{digest.hex()}.py{sys.version_info[0]}{sys.version_info[1]}.m{marshal.version}" if cache else None
    if entry is not None:
        try:
            blob = entry.read_bytes()
            if hashlib.sha256(blob[32:]).digest() == blob[:32]:
                ranks = marshal.loads(blob[32:])
                if isinstance(ranks, dict):
                    return ranks
        except (OSError, ValueError, EOFError, TypeError):
            pass
    ranks = read_tiktoken_ranks(path, data)
    if entry is not None:
        payload = marshal.dumps(ranks)
        with contextlib.suppress(OSError):
            entry.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(entry, hashlib.sha256(payload).digest() + payload)
    return ranks


@dataclass
class TiktokenTokenizer:
    """Tokenizer over a tiktoken BPE with a named special range above the ranks."""

    source: str
    encoding: "object"  # tiktoken.Encoding
    specials: dict[str, int]
    chat_template: str | None
    fingerprint: str
    vocab_size: int
    tool_declaration: str = "json"
    #: the most recent plain encodings, text -> a copy of its ids (see :meth:`decodes_to`)
    recent_plain: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: plain encodings made ahead (:meth:`encode_plain_ahead`), text -> ids, each handed out once
    ahead_plain: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: the opening blocks of recent prompts, text -> ids (:meth:`encode_prompt`)
    prompt_heads: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def encode_plain(self, text: str) -> list[int]:
        out = self.ahead_plain.pop(text, None) if self.ahead_plain else None
        if out is None:
            out = self._encode_ordinary(text)
        _remember(self.recent_plain, text, out)
        return out

    def encode_plain_ahead(self, texts: Iterable[str]) -> None:
        """Encode ``texts`` now, one after another, for :meth:`encode_plain` to hand each out once
        (the list itself: the caller owns it), replacing what an earlier call left unused. Encoding a
        batch's texts in a row runs faster than the same encodings between other work (about a
        quarter on drafter-sized answers): the BPE's tables stay in the CPU's caches."""
        ahead: dict[str, list[int]] = {}
        for text in texts:
            if text not in ahead:
                ahead[text] = self._encode_ordinary(text)
        self.ahead_plain = ahead

    def _encode_ordinary(self, text: str) -> list[int]:
        enc = self.encoding.encode_ordinary  # type: ignore[attr-defined]
        out: list[int] = []
        for piece in split_for_kimi(text):
            out.extend(enc(piece))
        return out

    def encode_with_specials(self, text: str) -> list[int]:
        """tiktoken's ``encode`` with every special token allowed, told only of the specials ``text``
        holds where that is provably the same (see :data:`SPECIAL_SHAPE`): tiktoken's core converts
        the allowed set it is given on every call, and all 256 of Kimi's cost about as much as encoding a
        short prompt's text."""
        enc = self.encoding.encode  # type: ignore[attr-defined]
        out: list[int] = []
        for piece in split_for_kimi(text):
            allowed = self.special_set.intersection(SPECIAL_SHAPE.findall(piece)) if self.specials_shaped else "all"
            out.extend(enc(piece, allowed_special=allowed, disallowed_special=()))
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """:meth:`encode_with_specials` of a rendered prompt, the same ids, with its opening system blocks
        (each ``<|im_system|>...<|im_end|>``: a Kimi prompt's tool declaration and system prompt, which a
        dataset's samples share) encoded once per distinct text (:data:`PROMPT_HEADS_KEPT` kept), the rest
        as it comes: on the recorded traffic they are about half of a prompt's encoding time.

        The same ids: the blocks end with a special token, and no special token a text holds can run
        across one (:data:`SPECIAL_SHAPE`: every special is shaped, so none holds another's start or end),
        so tiktoken, which encodes the text between the specials it finds one run at a time, encodes the
        blocks and the rest as it does the whole. Only where Kimi's long-input rule leaves the text whole
        (:func:`split_for_kimi`); else the text is encoded as one, as before."""
        end = self._prompt_head_end(text)
        if not end:
            return self.encode_with_specials(text)
        head = text[:end]
        ids = self.prompt_heads.get(head)
        if ids is None:
            ids = self.prompt_heads[head] = self.encode_with_specials(head)
            drop_oldest(self.prompt_heads, PROMPT_HEADS_KEPT)
        return ids + self.encode_with_specials(text[end:])  # (a new list: the kept one is never handed out)

    def _prompt_head_end(self, text: str) -> int:
        """Where the ``<|im_system|>...<|im_end|>`` blocks that open ``text`` end; 0 where none do, where
        they are longer than :data:`PROMPT_HEAD_MAX_CHARS`, or where the split is not provably exact."""
        if not (self.specials_shaped and _BLOCK_END in self.specials and text.startswith(_SYSTEM_BLOCK)):
            return 0
        if not kimi_keeps_whole(text):
            return 0  # Kimi's tokenizer cuts this text itself: encoded whole
        end = 0
        while text.startswith(_SYSTEM_BLOCK, end):
            close = text.find(_BLOCK_END, end)
            if close < 0:
                break
            end = close + len(_BLOCK_END)
        return end if end <= PROMPT_HEAD_MAX_CHARS else 0

    def decode(self, ids: Sequence[int]) -> str:
        """tiktoken's ``decode`` (UTF-8 with replacement), without its wrapper layers: the validation
        checks call it for every text segment."""
        return self.encoding.decode_bytes(ids if isinstance(ids, list) else list(ids)).decode("utf-8", "replace")  # type: ignore[attr-defined]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))  # type: ignore[attr-defined]

    def decodes_to(self, ids: list[int], text: str) -> bool:
        """Exactly ``decode(ids) == text``; proven without decoding when ``ids`` equal this tokenizer's
        own recent plain encoding of ``text`` (compared id for id): byte-level BPE encodes the UTF-8
        bytes of a text, and decoding gives those bytes back, for every text without a lone surrogate
        (tiktoken encodes one as U+FFFD, which does not decode back to it). Anything else is decoded."""
        known = self.recent_plain.get(text)
        if known is not None and known == ids and (text.isascii() or _no_surrogates(text)):
            return True
        return self.decode(ids) == text

    def special_id(self, name: str) -> int:
        try:
            return self.specials[name]
        except KeyError:
            raise TokenizerError(f"tokenizer {self.source}: no special token named {name!r}") from None

    def __post_init__(self) -> None:
        self.first_special_id = min(self.specials.values())
        self.special_set = frozenset(self.specials)
        self.specials_shaped = all(SPECIAL_SHAPE.fullmatch(name) for name in self.specials)

    def is_special_id(self, token_id: int) -> bool:
        return token_id >= self.first_special_id

    def special_names(self) -> dict[str, int]:
        return dict(self.specials)


def _special_table(config: dict, n_ranks: int, special_range: int, source: Path) -> dict[str, int]:
    named: dict[str, int] = {}
    for sid, entry in (config.get("added_tokens_decoder") or {}).items():
        try:
            named[entry["content"]] = int(sid)
        except (KeyError, ValueError, TypeError):
            raise TokenizerError(f"{source}: added_tokens_decoder[{sid!r}] has no usable 'content'/id") from None
    taken = set(named.values())
    for i in range(n_ranks, n_ranks + special_range):
        if i not in taken:
            named[f"<|reserved_token_{i}|>"] = i
    bad = {n: i for n, i in named.items() if i < n_ranks}
    if bad:
        raise TokenizerError(f"{source}: special tokens inside the BPE rank range: {bad}")
    return named


def _read_template(directory: Path, config: dict, override: str | Path | None) -> str | None:
    if override:
        return Path(override).read_text(encoding="utf-8")
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    tmpl = config.get("chat_template")
    return tmpl if isinstance(tmpl, str) else None


def load_tiktoken_dir(directory: str | Path, family: ModelFamily, chat_template: str | Path | None = None) -> TiktokenTokenizer:
    """Load a tiktoken-format directory (shared/tokenizers layout or a published Kimi model dir).

    The pattern comes from ``pattern.txt`` when present, else from the family. Shipped Python code
    (``tokenization_kimi.py``) is never imported.
    """
    import tiktoken

    directory = Path(directory)
    model_file = directory / "tiktoken.model"
    cfg_file = directory / "tokenizer_config.json"
    if not model_file.exists():
        raise TokenizerError(f"{directory}: no tiktoken.model")
    config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
    pattern_file = directory / "pattern.txt"
    pattern = pattern_file.read_text(encoding="utf-8").strip() if pattern_file.exists() else family.pattern
    model_bytes = model_file.read_bytes()
    model_digest = hashlib.sha256(model_bytes).digest()
    ranks = cached_tiktoken_ranks(model_file, model_bytes, model_digest)
    specials = _special_table(config, len(ranks), family.special_range, cfg_file)
    template = _read_template(directory, config, chat_template)
    encoding = tiktoken.Encoding(
        name=f"eagledata:{directory.name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    fingerprint = _sha256_parts(
        [
            model_digest,
            pattern.encode(),
            json.dumps(sorted(specials.items(), key=lambda kv: kv[1])).encode(),
            (template or "").encode(),
        ]
    )
    vocab_size = max(len(ranks) + family.special_range, max(specials.values()) + 1)
    return TiktokenTokenizer(str(directory), encoding, specials, template, fingerprint, vocab_size)


@dataclass
class HFTokenizer:
    """Adapter over a Hugging Face tokenizer (``AutoTokenizer``)."""

    source: str
    tok: "object"
    chat_template: str | None
    fingerprint: str
    vocab_size: int
    tool_declaration: str = "json"

    def encode_plain(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])  # type: ignore[operator]

    def encode_plain_ahead(self, texts: Iterable[str]) -> None:
        """Nothing: :meth:`encode_plain` encodes when asked."""

    def encode_with_specials(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode_with_specials(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]

    def decodes_to(self, ids: list[int], text: str) -> bool:
        return self.decode(ids) == text

    def special_id(self, name: str) -> int:
        vocab = self.tok.get_vocab()  # type: ignore[attr-defined]
        if name not in vocab:
            raise TokenizerError(f"tokenizer {self.source}: no token named {name!r}")
        return int(vocab[name])

    def special_names(self) -> dict[str, int]:
        return {t.content: int(i) for i, t in self.tok.added_tokens_decoder.items()}  # type: ignore[attr-defined]

    def is_special_id(self, token_id: int) -> bool:
        return token_id in self.tok.added_tokens_decoder  # type: ignore[attr-defined]


def load_hf(source: str, trust_remote_code: bool = False, chat_template: str | Path | None = None,
            revision: str | None = None) -> HFTokenizer:
    """``AutoTokenizer`` of a directory or hub id (``revision``: the hub commit, tag or branch to load;
    ``None``: the hub's default branch, whatever it holds now)."""
    from transformers import AutoTokenizer

    pinned = {"revision": revision} if revision is not None else {}
    tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **pinned)
    template = Path(chat_template).read_text(encoding="utf-8") if chat_template else getattr(tok, "chat_template", None)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    # a fast tokenizer's whole definition (merges, normalizer, pre-tokenizer...): what encodes, beyond the vocabulary
    backend = getattr(tok, "backend_tokenizer", None)
    fingerprint = _sha256_parts(
        [
            json.dumps(vocab, ensure_ascii=False).encode(),
            json.dumps(sorted((int(i), t.content) for i, t in tok.added_tokens_decoder.items())).encode(),
            (template or "").encode(),
            *([backend.to_str().encode()] if backend is not None else []),
        ]
    )
    return HFTokenizer(str(source), tok, template, fingerprint, len(tok))


def load_tokenizer(
    source: str | Path,
    family: ModelFamily,
    kind: str = "auto",
    trust_remote_code: bool = False,
    chat_template: str | Path | None = None,
    check: bool = True,
    revision: str | None = None,
) -> Tokenizer:
    """Load a tokenizer and run :func:`self_check` over the family's special tokens.

    ``kind``: ``tiktoken`` (tiktoken dir or published Kimi dir, never executing shipped code),
    ``hf`` (``AutoTokenizer``), or ``auto``: ``tiktoken`` when the directory holds
    ``tiktoken.model``, else ``hf``. ``revision`` pins a hub id's commit (or tag); a local
    directory has none, and is refused with one.
    """
    path = Path(source)
    if revision is not None and path.exists():
        raise TokenizerError(f"tokenizer {source}: a revision ({revision!r}) pins a hub id's files, and this is a "
                             "local path: remove tokenizer_revision, or give the hub id")
    if kind == "auto":
        kind = "tiktoken" if (path / "tiktoken.model").exists() else "hf"
    if kind == "tiktoken":
        if revision is not None:
            raise TokenizerError(f"tokenizer {source}: a revision ({revision!r}) needs a hub id (tokenizer_kind hf)")
        tok: Tokenizer = load_tiktoken_dir(path, family, chat_template)
    elif kind == "hf":
        tok = load_hf(str(source), trust_remote_code=trust_remote_code, chat_template=chat_template, revision=revision)
    else:
        raise TokenizerError(f"unknown tokenizer kind {kind!r} (tiktoken | hf | auto)")
    tok.tool_declaration = family.tool_declaration
    if check:
        self_check(tok, family.required_specials())
    return tok


def self_check(tok: Tokenizer, names: Iterable[str]) -> None:
    """For every name: its id decodes to exactly the name, and the name encodes (specials
    allowed) to exactly ``[id]``. Raises :class:`TokenizerSelfCheckError` on the first failure."""
    for name in names:
        try:
            tid = tok.special_id(name)
        except TokenizerError:
            raise TokenizerSelfCheckError(name, None, "not in the tokenizer", tok.source) from None
        decoded = tok.decode([tid])
        if decoded != name:
            raise TokenizerSelfCheckError(name, tid, f"id decodes to {decoded!r}", tok.source)
        encoded = tok.encode_with_specials(name)
        if encoded != [tid]:
            raise TokenizerSelfCheckError(name, tid, f"name encodes to {encoded}", tok.source)
        if tok.encode_plain(name) == [tid]:
            raise TokenizerSelfCheckError(name, tid, "plain-text encoding produced the special id", tok.source)
