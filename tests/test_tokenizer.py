import dataclasses
import json
import shutil

import pytest

from eagledata.text.families import KIMI_PATTERN, get_family
from eagledata.text.tokenizer import (
    MAX_NO_WHITESPACES_CHARS,
    TokenizerSelfCheckError,
    _split_runs,
    load_tokenizer,
    self_check,
    split_for_kimi,
)

from conftest import need_shared


def test_builtin_pattern_is_kimis(k25):
    assert need_shared("tokenizers", "kimi-k2.5", "pattern.txt").read_text().strip() == KIMI_PATTERN


def test_special_ids_come_from_the_tokenizer(k25):
    tok, fam = k25
    assert tok.vocab_size == 163840
    for name in fam.required_specials():
        tid = tok.special_id(name)
        assert tok.decode([tid]) == name
        assert tok.encode_with_specials(name) == [tid]
    # the documented table, checked against the loaded data (not used by the code)
    assert tok.special_id("<|im_end|>") == 163586 and tok.special_id("</think>") == 163607


def test_self_check_catches_a_wrong_id(k25):
    tok, fam = k25
    wrong = dataclasses.replace(tok, specials={**tok.specials, "<|im_end|>": 163533})
    with pytest.raises(TokenizerSelfCheckError) as err:
        self_check(wrong, fam.required_specials())
    assert err.value.name == "<|im_end|>" and err.value.token_id == 163533
    assert "chas" in str(err.value)


def test_self_check_catches_a_missing_name(k25):
    tok, _ = k25
    with pytest.raises(TokenizerSelfCheckError, match="not in the tokenizer"):
        self_check(tok, ["<|no_such_token|>"])


def test_special_ids_are_read_from_the_config_not_typed_in(tmp_path):
    src = need_shared("tokenizers", "kimi-k2.5")
    for f in ("tiktoken.model", "pattern.txt"):
        shutil.copy(src / f, tmp_path / f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    # swap two names: the loaded ids follow the data
    cfg["added_tokens_decoder"]["163586"]["content"] = "<|im_user|>"
    cfg["added_tokens_decoder"]["163587"]["content"] = "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path, get_family("kimi-k2.5"))  # self-consistent: passes
    assert tok.special_id("<|im_end|>") == 163587  # ids are read, never typed in


def test_plain_encoding_keeps_special_text_as_text(k25):
    tok, _ = k25
    text = "use <|im_end|> and </think> literally"
    plain = tok.encode_plain(text)
    assert tok.special_id("<|im_end|>") not in plain and tok.special_id("</think>") not in plain
    assert not any(tok.is_special_id(t) for t in plain)
    assert tok.decode(plain) == text
    assert tok.special_id("<|im_end|>") in tok.encode_with_specials(text)


def _all_specials_encoding(tok, text):
    """tiktoken told of every special token, piece by piece as Kimi splits a text."""
    return [t for piece in split_for_kimi(text) for t in tok.encoding.encode(piece, allowed_special="all")]


def test_prompt_encoding_names_only_the_specials_a_text_holds_and_encodes_as_if_told_of_all(k25):
    """Texts with specials next to, inside and around near-specials ("<|im_end|" "[[BOS]]" "<|a<|im_end|>"
    "<|[EOS]|>"...), in random mixes: the ids are tiktoken's told of every special."""
    import random
    tok, _ = k25
    assert tok.specials_shaped  # Kimi's specials take the fast path
    names = sorted(tok.special_names())
    pieces = ["<|", "|>", "[", "]", "<", ">", "|", "<|im_end|", "[BOS", "<|a", "<|[", "]|>", "x", " ", "\n", "héllo",
              "<|not_a_special|>", "[NOPE]", "[[", "]]", "<<|", "|>>", "<think", "</", "<thinker>", "<<think>>"]
    rng = random.Random(7)
    texts = ["<|a<|im_end|>", "[[BOS]]", "<|[EOS]|>", "<|im_end|", "[EOS", "<|im_user|><|im_end|>[BOS]", "",
             "<think></think>", "<<think>", "<thi<think>", "<|<think>|>", "[<think>]"]
    texts += ["".join(rng.choice(pieces + names[:20] + rng.sample(names, 3)) for _ in range(rng.randint(1, 40)))
              for _ in range(3000)]
    for text in texts:
        assert tok.encode_with_specials(text) == _all_specials_encoding(tok, text), text


def test_a_prompt_with_its_opening_blocks_kept_encodes_as_the_whole_text(k25):
    """encode_prompt keeps the encodings of a prompt's opening <|im_system|>...<|im_end|> blocks: the same
    ids as the whole text told of every special, whatever the blocks and the rest hold (specials and
    near-specials on both sides of the cut, an <|im_end|> inside a block, no block at all), from the first
    call and from what it kept; a list handed out can be changed without changing the next."""
    import random

    from eagledata.text.tokenizer import PROMPT_HEADS_KEPT

    tok, _ = k25
    names = sorted(tok.special_names())
    pieces = ["<|", "|>", "<|im_end|", "<|im_end|>", "<|im_system|>", "[BOS]", "<think>", "x", " ", "\n", "héllo",
              '{"a":1}', "<|not_a_special|>", "|", "<", ">"]
    rng = random.Random(11)

    def mix(n):
        return "".join(rng.choice(pieces + rng.sample(names, 2)) for _ in range(rng.randint(0, n)))

    texts = ["<|im_system|>", "<|im_system|><|im_end|>", "<|im_system|>a<|im_end|><|im_end|>b",
             "<|im_system|>tool_declare<|im_middle|>[]<|im_end|>\n<|im_user|>user<|im_middle|>hi<|im_end|>"]
    for _ in range(1500):
        blocks = "".join(f"<|im_system|>{mix(8)}<|im_end|>{rng.choice(['', '', chr(10)])}" for _ in range(rng.randint(0, 3)))
        texts.append(rng.choice(["", "<|im_system|>"]) + blocks + mix(20))
    tok.prompt_heads.clear()  # (the session's tokenizer: other tests' prompts may have filled it)
    for text in texts:
        want = _all_specials_encoding(tok, text)
        first = tok.encode_prompt(text)
        assert first == want, text
        first.append(-1)
        assert tok.encode_prompt(text) == want, text
    assert 0 < len(tok.prompt_heads) <= PROMPT_HEADS_KEPT


def test_a_prompt_kimis_tokenizer_cuts_is_encoded_whole(k25):
    """Past 400,000 characters, or with a run of 25,000 characters without (or of) white space, Kimi's
    tokenizer cuts the text itself: such a prompt is encoded whole, its blocks not kept."""
    tok, _ = k25
    head = "<|im_system|>tool_declare<|im_middle|>" + '{"x":"' + "y" * 30 + '"}<|im_end|>'
    for rest in ("a" * (MAX_NO_WHITESPACES_CHARS + 10), "word " * 90_000, "<|im_user|>" + " " * 30_000 + "z"):
        tok.prompt_heads.clear()
        text = head + rest
        assert tok.encode_prompt(text) == tok.encode_with_specials(text)
        assert not tok.prompt_heads


def test_recorded_prompts_encode_alike_either_way():
    from conftest import need_shared

    from eagledata.text.chat import prompt_text

    requests = [json.loads(line)["request"] for line in
                need_shared("recorded", "openrouter-kimi-k2-0905.jsonl").open(encoding="utf-8")]
    for name, family in (("kimi-k2-instruct", "kimi-k2"), ("kimi-k2-thinking", "kimi-k2-thinking"), ("kimi-k2.5", "kimi-k2.5")):
        tok = load_tokenizer(need_shared("tokenizers", name), get_family(family))
        for req in requests:
            text = prompt_text(tok, req["messages"], req.get("tools"))
            assert tok.encode_prompt(text) == tok.encode_with_specials(text)
        assert tok.prompt_heads  # the recorded prompts open with a tool declaration or a system prompt


def test_a_tokenizer_with_specials_of_another_shape_tells_tiktoken_of_them_all(k25):
    import tiktoken
    tok, _ = k25
    specials = {**tok.specials, "<<odd>>": max(tok.specials.values()) + 1}
    encoding = tiktoken.Encoding(name="odd", pat_str=tok.encoding._pat_str, mergeable_ranks=tok.encoding._mergeable_ranks,
                                 special_tokens=specials)
    odd = dataclasses.replace(tok, encoding=encoding, specials=specials)
    assert not odd.specials_shaped
    text = "a<<odd>>b<|im_end|>[BOS]"
    assert odd.encode_with_specials(text) == _all_specials_encoding(odd, text)
    assert specials["<<odd>>"] in odd.encode_with_specials(text)
    prompt = "<|im_system|>s<<odd>><|im_end|>" + text
    assert odd.encode_prompt(prompt) == _all_specials_encoding(odd, prompt) and not odd.prompt_heads


def _reference_split(text, window=400_000, max_len=MAX_NO_WHITESPACES_CHARS):
    for i in range(0, len(text), window):
        yield from _split_runs(text[i:i + window], max_len)


@pytest.mark.parametrize("text", [
    "short text",
    " " * 25_000 + "x",
    " " * 25_001 + "abc",
    "a" * 60_000,
    ("word " * 90_000) + "z" * 30_000,
    "x" * 400_001,
])
def test_long_input_split_matches_kimis_rule(text):
    assert list(split_for_kimi(text)) == list(_reference_split(text))


def test_long_runs_encode_like_kimi_pieces(k25):
    tok, _ = k25
    text = "a" * 30_000 + " " * 26_000 + "end"
    pieces = list(_reference_split(text))
    assert len(pieces) > 2
    expected = [t for p in pieces for t in tok.encoding.encode_ordinary(p)]
    assert tok.encode_plain(text) == expected


def test_encodings_made_ahead_are_the_plain_encodings_each_handed_out_once(k25, monkeypatch):
    """encode_plain after encode_plain_ahead returns what it returns without (long runs split included),
    hands an encoding made ahead out once (a list the caller may change), and drops what the next call
    does not ask for again."""
    tok, _ = k25
    texts = ["reasoning </think> <|im_end|> stays text", "a" * 30_000 + " " * 26_000 + "end", "{\"k\": 1}", "é 🙂 naïve"]
    expected = {t: tok.encode_plain(t) for t in texts}
    calls = []
    real = tok._encode_ordinary
    monkeypatch.setattr(tok, "_encode_ordinary", lambda text: calls.append(text) or real(text))
    try:
        tok.encode_plain_ahead(texts + texts[:1])  # a text listed twice is encoded once
        assert calls == texts
        first = tok.encode_plain(texts[0])
        assert first == expected[texts[0]] and len(calls) == len(texts)  # handed out, not encoded again
        first.append(-1)  # the caller's list
        assert tok.encode_plain(texts[0]) == expected[texts[0]] and len(calls) == len(texts) + 1  # once only
        tok.encode_plain_ahead(texts[3:])  # replaces what is left of the first batch
        calls.clear()
        for t in texts:
            assert tok.encode_plain(t) == expected[t]
        assert calls == texts[:3]  # only the new batch's text was made ahead
        assert not tok.ahead_plain
    finally:
        tok.encode_plain_ahead(())  # the session's tokenizer holds nothing made ahead


def test_fingerprint_covers_the_template(tmp_path, k25):
    tok, fam = k25
    src = need_shared("tokenizers", "kimi-k2.5")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    same = load_tokenizer(tmp_path, fam)
    assert same.fingerprint == tok.fingerprint
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert load_tokenizer(tmp_path, fam).fingerprint != tok.fingerprint


def test_published_kimi_dir_loads_without_running_its_code(tmp_path):
    """A model directory as published: no pattern.txt, a tokenization_kimi.py that must not run."""
    src = need_shared("tokenizers", "kimi-k2.5")
    for f in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, tmp_path / f)
    (tmp_path / "tokenization_kimi.py").write_text("raise RuntimeError('shipped code must never be executed')\n")
    tok = load_tokenizer(tmp_path, get_family("kimi-k2.5"))
    ref = load_tokenizer(src, get_family("kimi-k2.5"))
    sample = "中文混合 English, numbers 12345 and émoji 🎉"
    assert tok.encode_plain(sample) == ref.encode_plain(sample)


def test_rank_tables_are_cached_by_content_and_a_damaged_entry_is_decoded_again(tmp_path, monkeypatch):
    """Every per-shard job loads the tokenizer: the decoded rank table is kept between processes,
    named by the rank file's sha256; an entry that does not check is never used."""
    import hashlib
    import marshal

    src = need_shared("tokenizers", "kimi-k2.5")
    fam = get_family("kimi-k2.5")
    cache = tmp_path / "cache"
    monkeypatch.setenv("EAGLEDATA_CACHE_DIR", str(cache))
    sample = "中文混合 English, numbers 12345 and émoji 🎉"
    fresh = load_tokenizer(src, fam)
    entries = list((cache / "tiktoken-ranks").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith(hashlib.sha256((src / "tiktoken.model").read_bytes()).hexdigest())
    expected = fresh.encode_plain(sample)

    # the entry is what the next load uses: a table changed in it (with a matching checksum) shows
    table = marshal.loads(entries[0].read_bytes()[32:])
    hello = fresh.encoding.encode_ordinary("hello")
    assert len(hello) == 1
    swapped = next(b for b, r in table.items() if r == hello[0])
    table[swapped], table[b"!"] = table[b"!"], table[swapped]
    payload = marshal.dumps(table)
    entries[0].write_bytes(hashlib.sha256(payload).digest() + payload)
    assert load_tokenizer(src, fam).encoding.encode_ordinary("hello") != hello

    # a damaged entry (its checksum no longer holds) is decoded again from the rank file and rewritten
    blob = bytearray(entries[0].read_bytes())
    blob[-10] ^= 0xFF
    entries[0].write_bytes(bytes(blob))
    again = load_tokenizer(src, fam)
    assert again.encode_plain(sample) == expected and again.encoding.encode_ordinary("hello") == hello
    assert marshal.loads(entries[0].read_bytes()[32:]) == marshal.loads(marshal.dumps(dict(fresh.encoding._mergeable_ranks)))

    # another rank file gets its own entry; a cache that cannot be written is skipped
    other = tmp_path / "other"
    shutil.copytree(src, other)
    lines = (other / "tiktoken.model").read_bytes().splitlines(keepends=True)
    (other / "tiktoken.model").write_bytes(b"".join(lines[:-1]))
    load_tokenizer(other, fam)
    assert len(list((cache / "tiktoken-ranks").iterdir())) == 2
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("EAGLEDATA_CACHE_DIR", str(blocked))
    assert load_tokenizer(src, fam).encode_plain(sample) == expected
    monkeypatch.setenv("EAGLEDATA_CACHE_DIR", "")  # empty: no cache
    assert load_tokenizer(src, fam).encode_plain(sample) == expected


def test_tokenizer_settings_of_a_stage_stamp_load_what_the_config_loads(tmp_path):
    """token_shard loads its tokenizer from the settings its stage stamp carries (rules/common.smk
    tokenizer_settings); they give the tokenizer and family the config gives, a config-defined family
    and a chat template override included."""
    from eagledata.codeinputs import stamp_settings, write_stamp
    from eagledata.config import load_model_tokenizer, tokenizer_from_settings

    src = need_shared("tokenizers", "kimi-k2.5")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    families = {"k25-local": {"base": "kimi-k2.5", "tool_declaration": "json"}}
    model = {"family": "k25-local", "tokenizer": str(src), "tokenizer_kind": "auto", "trust_remote_code": False,
             "chat_template": str(template)}
    config = {"models": {"m": model}, "families": families}
    settings = {**{k: model.get(k) for k in ("tokenizer", "tokenizer_kind", "trust_remote_code", "chat_template", "family")},
                "family_definition": families["k25-local"]}
    write_stamp([template], tmp_path / "stamp.sha256", settings=settings)
    tok, fam = tokenizer_from_settings(stamp_settings(tmp_path / "stamp.sha256"))
    ref = load_model_tokenizer(config, "m")
    assert tok.fingerprint == ref.fingerprint and tok.chat_template == template.read_text()
    assert fam == get_family("k25-local", families) and fam.tool_declaration == "json" != get_family("kimi-k2.5").tool_declaration
    write_stamp([template], tmp_path / "plain.sha256")
    assert stamp_settings(tmp_path / "plain.sha256") is None
    with pytest.raises(Exception, match="no tokenizer settings"):
        tokenizer_from_settings(None)


def _tiny_hf_tokenizer(dest, template: str) -> None:
    """A small byte-level BPE Hugging Face tokenizer with the Kimi K2 family's special tokens and
    ``template`` as its chat template, saved in ``dest``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the tokens of a hub tokenizer, pinned"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(list(get_family("kimi-k2").required_specials()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe)
    fast.chat_template = template
    fast.save_pretrained(dest)


def _hub_snapshot(cache, repo: str, commit: str, template: str) -> None:
    """A Hugging Face hub cache entry (the layout huggingface_hub reads offline) holding, at
    ``commit``, :func:`_tiny_hf_tokenizer` (a tokenizer-only repo); the repo's ``main`` then points
    at ``commit``."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    _tiny_hf_tokenizer(entry / "snapshots" / commit, template)
    (entry / ".no_exist" / commit).mkdir(parents=True)  # a tokenizer-only repo: the hub has no config.json
    (entry / ".no_exist" / commit / "config.json").touch()
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / "main").write_text(commit)


def test_a_pinned_revision_loads_that_commit_of_a_hub_id(tmp_path):
    """models.NAME.tokenizer_revision pins a hub id's files: with it the tokenizer is the pinned
    commit's (also as a stage stamp's settings carry it), without it the hub's main, which moved on
    (here: a revised chat template, so another fingerprint). Real hub resolution, offline, from a hub
    cache in the layout huggingface_hub reads. A revision for a local directory is refused."""
    import subprocess
    import sys

    old, new = "1" * 40, "2" * 40
    _hub_snapshot(tmp_path / "hub", "org/tiny", old, "{% for m in messages %}{{ m.content }}{% endfor %}")
    _hub_snapshot(tmp_path / "hub", "org/tiny", new, "{% for m in messages %}{{ m.role }}{{ m.content }}{% endfor %}")
    code = """
import json, sys
from eagledata.codeinputs import stamp_settings, write_stamp
from eagledata.config import load_model_tokenizer, tokenizer_from_settings
def model(revision):
    return {"family": "kimi-k2", "tokenizer": "org/tiny", "tokenizer_revision": revision}
out = {}
for name, revision in (("main", None), ("pinned", sys.argv[1])):
    tok = load_model_tokenizer({"models": {"m": model(revision)}}, "m")
    out[name] = [tok.chat_template, tok.fingerprint]
write_stamp([], sys.argv[2], settings={**model(sys.argv[1]), "family_definition": None})
tok, _ = tokenizer_from_settings(stamp_settings(sys.argv[2]))
out["stamped"] = [tok.chat_template, tok.fingerprint]
print(json.dumps(out))
"""
    env = {**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code, old, str(tmp_path / "stamp.sha256")], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["pinned"][0].startswith("{% for m in messages %}{{ m.content }}")
    assert out["main"][0].startswith("{% for m in messages %}{{ m.role }}")
    assert out["pinned"][1] != out["main"][1] and out["stamped"] == out["pinned"]
    from eagledata.generate.tokenizers import tokenizer_problem
    from eagledata.text.tokenizer import TokenizerError

    local = need_shared("tokenizers", "kimi-k2.5")
    with pytest.raises(TokenizerError, match="pins a hub id's files, and this is a local path"):
        load_tokenizer(local, get_family("kimi-k2.5"), revision=old)
    problem = tokenizer_problem({"tokenizer": str(local), "tokenizer_revision": old}, "m")
    assert problem is not None and "is a local path" in problem and "(models.m.tokenizer_revision)" in problem


def test_a_hugging_face_tokenizers_fingerprint_covers_how_it_encodes(tmp_path):
    """Two Hugging Face tokenizers with the same vocabulary, special tokens and chat template that
    encode differently (another pre-tokenizer setting) have different fingerprints; the same files
    give the same fingerprint in another process (the per-shard jobs and the gathering job compare)."""
    import subprocess
    import sys

    fam = get_family("kimi-k2")
    a, b = tmp_path / "a", tmp_path / "b"
    _tiny_hf_tokenizer(a, "{{ messages }}")
    shutil.copytree(a, b)
    spec = json.loads((b / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    (b / "tokenizer.json").write_text(json.dumps(spec))
    ta, tb = load_tokenizer(a, fam), load_tokenizer(b, fam)
    assert ta.encode_plain("tokens") != tb.encode_plain("tokens")  # they encode differently
    assert ta.tok.get_vocab() == tb.tok.get_vocab() and ta.chat_template == tb.chat_template
    assert ta.fingerprint != tb.fingerprint
    code = "import sys; from eagledata.text.families import get_family; from eagledata.text.tokenizer import load_tokenizer; " \
           "print(load_tokenizer(sys.argv[1], get_family('kimi-k2')).fingerprint)"
    other = subprocess.run([sys.executable, "-c", code, str(a)], capture_output=True, text=True, check=True)
    assert other.stdout.split()[-1] == ta.fingerprint
