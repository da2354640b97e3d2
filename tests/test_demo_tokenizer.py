"""The demo tokenizer (eagledata.demo.tokenizer) and the demo prompt datasets."""

from __future__ import annotations

import json
import random
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiktoken

from eagledata.demo import tokenizer as dt
from eagledata.text.chat import render_chat
from eagledata.text.families import KIMI_PATTERN, get_family
from eagledata.text.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED_KIMI = REPO.parent / "shared" / "tokenizers" / "kimi-k2.5"
FAMILY = get_family("kimi-k2.5")

UNSEEN = [
    "Héllo wörld! Ünïcödé naïve café, résumé, façade, Crème Brûlée.",
    "你好，世界。机器学习是人工智能的一个分支。Mixed 中文 and English text.",
    "Emoji: 🙂🚀🍣 family 👨\u200d👩\u200d👧 flags 🇯🇵 skin 👍🏽 and ✔︎ symbols.",
    "ΑΒΓ δέλτα, Привет мир, مرحبا, שלום, नमस्ते, ＡＢＣ fullwidth, ǅ titlecase.",
    "It's THEY'RE DON'T we'll I'M she'd  \n\n\t  x=1234567890 y=-3.14e-10\r\n\r\n",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n\n\n    \t",
    "<|im_end|> <think>literal</think> [BOS] <|tool_call_begin|>functions.x:0",
]


@pytest.fixture(scope="module")
def corpus() -> str:
    return dt.default_corpus_path().read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def trained(corpus):
    t0 = time.perf_counter()
    ranks, splits = dt.train(corpus, dt.DEFAULT_N_RANKS - 256, KIMI_PATTERN)
    return ranks, splits, time.perf_counter() - t0


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return dt.build_demo_tokenizer(None, tmp_path_factory.mktemp("demo") / "demo-tokenizer")


@pytest.fixture(scope="module")
def tok(built):
    return load_tokenizer(built, FAMILY)


def _tiktoken(ranks):
    return tiktoken.Encoding("demo-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})


def _random_unicode(seed: int, n: int) -> str:
    rng = random.Random(seed)
    pools = [(32, 127), (0xA0, 0x800), (0x900, 0xFFF), (0x3000, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF)]
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(rng.choice(" 'sStTdDmMlLvVrReE\n\r\t0123456789"))
        else:
            lo, hi = rng.choice(pools)
            out.append(chr(rng.randrange(lo, hi)))
    return "".join(out)


# ---------------------------------------------------------------------------- trainer


def test_rank_layout(trained):
    ranks, _, seconds = trained
    assert len(ranks) == dt.DEFAULT_N_RANKS == 1792
    assert sorted(ranks.values()) == list(range(1792))
    assert all(ranks[bytes([i])] == i for i in range(256))
    # every merged token is the concatenation of two lower-ranked tokens
    for tok, r in ranks.items():
        if r >= 256:
            assert any(ranks.get(tok[:i], r) < r and ranks.get(tok[i:], r) < r for i in range(1, len(tok))), tok
    assert seconds < 30, f"training took {seconds:.1f} s"


def test_trainer_splits_equal_tiktoken_on_corpus(trained, corpus):
    """The trainer's final split of every distinct corpus chunk is tiktoken's encoding of it."""
    ranks, splits, _ = trained
    enc = _tiktoken(ranks)
    mismatches = {c: (w, enc.encode_ordinary(c.decode("utf-8"))) for c, w in splits.items()
                  if enc.encode_ordinary(c.decode("utf-8")) != w}
    assert not mismatches, list(mismatches.items())[:5]
    # and the whole corpus, through the pure-Python merge application
    assert enc.encode_ordinary(corpus) == dt.bpe_encode(corpus, ranks, KIMI_PATTERN)


@pytest.mark.parametrize("text", UNSEEN + [_random_unicode(1, 20000), _random_unicode(2, 20000)])
def test_trainer_merge_application_equals_tiktoken_on_unseen_text(trained, text):
    ranks, _, _ = trained
    enc = _tiktoken(ranks)
    ids = enc.encode_ordinary(text)
    assert ids == dt.bpe_encode(text, ranks, KIMI_PATTERN)
    assert enc.decode(ids) == text


def test_recombined_corpus_words_agree(trained, corpus):
    """New chunks built from corpus words (not themselves in the corpus) merge the same way."""
    ranks, _, _ = trained
    rng = random.Random(5)
    words = sorted(set(dt.pretokenize(corpus, KIMI_PATTERN)))
    text = "".join(rng.choice(words) + rng.choice(["", " ", "\n", "_", "é", "中"]) for _ in range(20000))
    assert _tiktoken(ranks).encode_ordinary(text) == dt.bpe_encode(text, ranks, KIMI_PATTERN)


def test_pattern_needs_class_intersection():
    """Kimi's pattern keeps Han characters out of the letter classes (``&&[^\\p{Han}]``)."""
    assert dt.pretokenize("abc你好def", KIMI_PATTERN) == ["abc", "你好", "def"]
    assert dt.pretokenize(" Hello's world", KIMI_PATTERN) == [" Hello's", " world"]


def test_small_training_is_deterministic_and_exact():
    text = "low lower lowest newer newest wider widest " * 20
    a = dt.train_byte_bpe(text, 20, KIMI_PATTERN)
    assert list(a.items()) == list(dt.train_byte_bpe(text, 20, KIMI_PATTERN).items())
    assert len(a) == 276 and sorted(a.values()) == list(range(276))
    # the most frequent pair goes first ("we": 80); ties go to the smaller byte string ("lo" and
    # "st": 60 each)
    assert (a[b"we"], a[b"lo"], a[b"st"]) == (256, 257, 258)
    with pytest.raises(ValueError, match="corpus too small"):
        dt.train_byte_bpe("ab ab", 50, KIMI_PATTERN)


def test_every_token_merges_to_itself(trained):
    """Merging a token's own bytes yields the token, so tiktoken's shortcut for a piece that is a
    token changes nothing."""
    ranks, _, _ = trained
    vocab = sorted(ranks, key=ranks.get)
    assert all(dt.merge_to_end(list(t), vocab, ranks) == [ranks[t]] for t in vocab)


# ---------------------------------------------------------------------------- the directory


def test_build_is_deterministic(tmp_path, built):
    again = dt.build_demo_tokenizer(dt.default_corpus_path(), tmp_path / "again")
    names = sorted(p.name for p in built.iterdir())
    assert names == ["DEMO.md", "chat_template.jinja", "pattern.txt", "tiktoken.model", "tokenizer_config.json"]
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (built / name).read_bytes() == (again / name).read_bytes(), name


def test_different_corpus_gives_different_ranks(tmp_path, corpus):
    other = tmp_path / "other.txt"
    other.write_text(corpus[: len(corpus) // 2], encoding="utf-8")
    a = dt.build_demo_tokenizer(other, tmp_path / "a", n_ranks=512)
    b = dt.build_demo_tokenizer(None, tmp_path / "b", n_ranks=512)
    assert (a / "tiktoken.model").read_bytes() != (b / "tiktoken.model").read_bytes()
    assert json.loads((a / "tokenizer_config.json").read_text())["vocab_size"] == 768


def test_self_check_and_sizes(tok, built):
    assert tok.vocab_size == dt.DEMO_VOCAB_SIZE == 2048
    cfg = json.loads((built / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["vocab_size"] == 2048
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert (built / "pattern.txt").read_text(encoding="utf-8").strip() == KIMI_PATTERN
    assert tok.chat_template == dt.kimi_k25_chat_template()
    for name, tid in tok.special_names().items():
        assert tok.decode([tid]) == name
        assert tok.encode_with_specials(name) == [tid]


def test_special_ids_at_kimi_offsets(tok, built):
    first = 1792
    expected = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
                "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11, "<|tool_call_begin|>": 13,
                "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15, "<|tool_calls_section_end|>": 12,
                "<|im_middle|>": 17, "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255}
    for name, off in expected.items():
        assert tok.special_id(name) == first + off, name
    for name in FAMILY.required_specials():
        assert tok.special_id(name) >= first
    flags = {v["content"]: v["special"] for v in json.loads((built / "tokenizer_config.json").read_text())["added_tokens_decoder"].values()}
    assert flags["<|im_end|>"] is True and flags["</think>"] is False and flags["<|tool_call_begin|>"] is False
    # reserved ids fill the rest of the 256-id range
    assert sorted(tok.special_names().values()) == list(range(first, first + 256))


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_KIMI.exists(), reason="needs ../shared/tokenizers/kimi-k2.5")
def test_embedded_table_matches_real_kimi(built):
    kimi = json.loads((SHARED_KIMI / "tokenizer_config.json").read_text(encoding="utf-8"))
    first = min(int(i) for i in kimi["added_tokens_decoder"])
    real = {(v["content"], int(i) - first, v["special"]) for i, v in kimi["added_tokens_decoder"].items()}
    assert set(dt.KIMI_SPECIAL_TOKENS) == real
    assert list(dt.KIMI_ADDITIONAL_SPECIAL_TOKENS) == kimi["additional_special_tokens"]
    assert (built / "chat_template.jinja").read_bytes() == (SHARED_KIMI / "chat_template.jinja").read_bytes()
    assert (SHARED_KIMI / "pattern.txt").read_text(encoding="utf-8").strip() == KIMI_PATTERN


def test_literal_special_text_stays_plain(tok):
    for name in ("<|im_end|>", "</think>", "<|tool_call_begin|>", "[BOS]"):
        text = f"print('{name}')  # {name}"
        ids = tok.encode_plain(text)
        assert all(not tok.is_special_id(i) for i in ids), (name, ids)
        assert tok.decode(ids) == text
        assert tok.special_id(name) in tok.encode_with_specials(text)


def test_decode_encode_roundtrip_on_corpus_slices(tok, corpus):
    rng = random.Random(11)
    for _ in range(200):
        i = rng.randrange(len(corpus))
        piece = corpus[i : i + rng.randrange(1, 3000)]
        assert tok.decode(tok.encode_plain(piece)) == piece
    for text in UNSEEN:
        assert tok.decode(tok.encode_plain(text)) == text


# ---------------------------------------------------------------------------- demo prompts


def _load(name: str) -> list[dict]:
    path = REPO / "config" / "demo" / name
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_prompt_files_shape():
    chat, tools = _load("chat.jsonl"), _load("tools.jsonl")
    assert len(chat) == 24 and len(tools) == 16
    ids = [r["id"] for r in chat + tools]
    assert len(set(ids)) == len(ids)
    assert all("tools" not in r for r in chat) and all(r["tools"] for r in tools)
    assert any(m["role"] == "system" for r in chat for m in r["messages"])
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) >= 2 for r in chat)
    text = json.dumps(chat + tools, ensure_ascii=False)
    assert re.search(r"[\u4e00-\u9fff]", text) and re.search(r"[éèçüö]", text) and re.search(r"[\U0001F300-\U0001FAFF]", text)
    for r in chat + tools:
        assert r["messages"][-1]["role"] in ("user", "tool"), r["id"]
    for r in tools:
        for t in r["tools"]:
            assert t["type"] == "function" and t["function"]["name"] and t["function"]["parameters"]["type"] == "object"


def test_tool_call_ids_are_native_and_counted_across_the_conversation():
    tools = _load("tools.jsonl")
    multi = 0
    for r in tools:
        declared = {t["function"]["name"] for t in r["tools"]}
        seen: list[str] = []
        for m in r["messages"]:
            for call in m.get("tool_calls") or []:
                name = call["function"]["name"]
                assert name in declared
                assert call["id"] == FAMILY.native_tool_call_id(name, len(seen)), (r["id"], call["id"])
                json.loads(call["function"]["arguments"])
                seen.append(call["id"])
            if m["role"] == "tool":
                assert m["tool_call_id"] in seen, (r["id"], m["tool_call_id"])
        multi += bool(seen)
    assert multi >= 8 and len(tools) - multi >= 4


@pytest.mark.parametrize("name", ["chat.jsonl", "tools.jsonl"])
def test_every_demo_prompt_renders_and_encodes(tok, name):
    gen_prompt = "<|im_assistant|>assistant<|im_middle|><think>"
    end = tok.special_id("<|im_end|>")
    for r in _load(name):
        text = render_chat(tok.chat_template, r["messages"], r.get("tools"))
        assert text.endswith(gen_prompt), r["id"]
        ids = tok.encode_with_specials(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert ids.count(end) == len(r["messages"]) + bool(r.get("tools")), r["id"]
        calls = sum(len(m.get("tool_calls") or []) for m in r["messages"])
        assert ids.count(tok.special_id("<|tool_call_begin|>")) == calls
        assert ids[-1] == tok.special_id("<think>")


# ---------------------------------------------------------------------------- script


def test_script_snakemake_entry_writes_log(tmp_path, built):
    out, log = tmp_path / "out", tmp_path / "logs" / "demo.log"
    log.parent.mkdir()
    from eagledata.codeinputs import stamp_file

    # the job's code stamp (the rule declares one; the job checks it ran that code): every project module
    # this process has loaded, the script's among them
    loaded = sorted(m.__file__ for n, m in sys.modules.items()
                    if (n == "eagledata" or n.startswith("eagledata.")) and getattr(m, "__file__", None))
    code = stamp_file(loaded, tmp_path / "stamps", "build_demo_tokenizer")
    fake = SimpleNamespace(output=[str(out)], log=[str(log)],
                           input=SimpleNamespace(corpus=str(dt.default_corpus_path()), code=[str(code)]))
    runpy.run_path(str(REPO / "scripts" / "build_demo_tokenizer.py"), init_globals={"snakemake": fake})
    assert (out / "tiktoken.model").read_bytes() == (built / "tiktoken.model").read_bytes()
    assert "trained 1792 ranks" in log.read_text()


def test_script_command_line(tmp_path, built):
    out = tmp_path / "cli"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_tokenizer.py"), str(out)], check=True,
                   capture_output=True)
    assert (out / "tokenizer_config.json").read_bytes() == (built / "tokenizer_config.json").read_bytes()
