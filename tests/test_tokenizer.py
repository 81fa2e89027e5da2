"""Tests for timlab.tokenizer: the char tokenizer, its HF folder, and loading other folders."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timlab.tasks import TASKS, get_task
from timlab.tokenizer import build_char_tokenizer, load_tokenizer, save_char_tokenizer

# the char tokenizer serves the synthetic tasks (the dataset task brings its own model folder)
CHARS = "".join(sorted(set("".join(get_task(n).alphabet for n in TASKS if not TASKS.get(n).needs_model_path)))) + " "
SAMPLES = ["rev:a3k9=9k3a", "add:12+345=357", "cd:3,7,25,50>75=(50-25)*3", "  a  b ", "", " "]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    return save_char_tokenizer(CHARS, tmp_path_factory.mktemp("char_tok"))


def test_special_ids_and_vocab_order():
    tok = build_char_tokenizer("cab b")
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [0, 1, 2, 3]
    assert [tok.token_to_id(c) for c in " abc"] == [4, 5, 6, 7]  # sorted unique chars
    assert tok.get_vocab_size(with_added_tokens=True) == 8
    assert tok.encode("ab c?", add_special_tokens=False).ids == [5, 6, 4, 7, 3]  # ? -> <unk>


def test_decode_skips_special_tokens_and_inserts_no_spaces():
    tok = build_char_tokenizer("ab ")
    assert tok.decode([1, 5, 6, 4, 4, 5, 2, 0], skip_special_tokens=True) == "ab  a"
    assert tok.decode([1, 5, 2], skip_special_tokens=False) == "<bos>a<eos>"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=CHARS, max_size=60))
def test_round_trip_over_the_task_alphabet(text):
    tok = build_char_tokenizer(CHARS)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text)  # one token per character
    assert all(i >= 4 for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_saved_folder_loads_with_timlab(char_dir):
    assert sorted(p.name for p in char_dir.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((char_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["eos_token"], config["model_max_length"]) == ("<eos>", 1024)
    tok = load_tokenizer(char_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == 4 + len(set(CHARS)) == 50
    assert tok.name_or_path == str(char_dir)
    ref = build_char_tokenizer(CHARS)
    for s in SAMPLES:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False).ids
        assert tok.decode(tok.encode(s)) == s
    assert tok.batch_encode(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert tok.decode([1] + tok.encode("a b") + [2, 0]) == "a b"
    assert tok.decode([1, 2], skip_special_tokens=False) == "<bos><eos>"
    assert load_tokenizer(char_dir / "tokenizer.json").encode("a b") == tok.encode("a b")


@pytest.mark.parametrize("cls_name", ["PreTrainedTokenizerFast", "AutoTokenizer"])
def test_transformers_loads_the_char_folder_with_the_same_ids(char_dir, cls_name):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, cls_name).from_pretrained(str(char_dir))
    tok = load_tokenizer(char_dir)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    assert len(hf) == tok.vocab_size
    for s in SAMPLES:
        ids = hf.encode(s, add_special_tokens=False)
        assert ids == tok.encode(s)
        assert hf.decode(ids, skip_special_tokens=True) == s
    assert hf("ab").input_ids == tok.encode("ab")  # no BOS/EOS added by default


def test_qwen2_folder_keeps_spaces(char_dir, tmp_path):
    """A Qwen2 model folder: AutoTokenizer would build Qwen2Tokenizer and drop the spaces."""
    for f in char_dir.iterdir():
        (tmp_path / f.name).write_text(f.read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 2}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("a b") == [24, 4, 25]  # "a" = 4 specials + " ()*+,-" + 10 digits + ":=>"
    assert tok.decode(tok.encode("rev: a b=")) == "rev: a b="


def test_eos_from_generation_config_and_pad_fallback(tmp_path):
    build_char_tokenizer("ab").save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, None)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 1}))
    tok = load_tokenizer(tmp_path)  # generation_config.json is read before config.json
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, 1)


def test_missing_or_empty_folders_raise_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; expected a folder with tokenizer"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="expected tokenizer.json") as info:
        load_tokenizer(tmp_path)  # exists but empty
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    build_char_tokenizer("ab").save(str(tmp_path / "tokenizer.json"))  # no EOS anywhere
    with pytest.raises(ValueError, match="no EOS token found"):
        load_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="eos token '</s>'.*not in the vocabulary"):
        load_tokenizer(tmp_path)


def _tiny_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = ["hello world", "the quick brown fox", "jumps over the lazy dog", "hello fox"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


HF_TEXTS = ["hello brown dog, lazy fox!", "the  quick\nworld", "zebra?"]


def test_real_hf_tokenizer_folder_loads_with_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tiny_bpe(), eos_token="<|end|>", pad_token="<|pad|>")
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 1, None)
    assert tok.vocab_size == len(hf)
    for s in HF_TEXTS:
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False)
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode("hello world")) < len("hello world")  # merges were learned


def test_folder_without_tokenizer_json_falls_back_to_autotokenizer(tmp_path):
    """vocab.json + merges.txt only (a GPT-2 style folder): loaded through AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    bpe = _tiny_bpe()
    bpe.model.save(str(tmp_path))  # vocab.json, merges.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|end|>", "add_prefix_space": False}))
    assert not (tmp_path / "tokenizer.json").exists()
    tok = load_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 0)
    for s in HF_TEXTS:
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False)
        assert tok.encode(s) == bpe.encode(s).ids


# ---------------------------------------------------------------------------- chat-template work budget (issue 42)
def _templated(folder, template: str):
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    save_char_tokenizer("abcxyz ", folder)
    (folder / "chat_template.jinja").write_text(template)
    return load_tokenizer(folder)


MSGS = [{"role": "user", "content": "abc"}]


def test_42_5_nested_template_loops_stop_at_the_line_budget(tmp_path, monkeypatch):
    """Finding 5: the sandbox caps one range() but not range() inside range(); each render now
    has a budget of template lines, the same on every machine."""
    import sys
    import time

    import timlab.tokenizer as tokenizer_mod

    pytest.importorskip("transformers")
    ok = _templated(tmp_path / "ok", "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    assert ok.render_chat(MSGS) == "[user] abc"
    nested = "{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}done"
    tok = _templated(tmp_path / "nested", nested)
    monkeypatch.setattr(tokenizer_mod, "TEMPLATE_MAX_LINES", 100_000)  # 4 million iterations would be needed
    before = sys.gettrace()
    t0 = time.perf_counter()
    with pytest.raises(tokenizer_mod.TemplateBudgetError) as e:
        tok.render_chat(MSGS)
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and "ran past its work budget (more than 100,000 lines of template code)" in msg
    assert sys.gettrace() is before  # the trace function in place before is back
    assert ok.render_chat(MSGS) == "[user] abc"  # and the budget is per render
    # what an ordinary template uses, counted exactly: its loop body runs once per message
    lines = []
    for limit in range(1, 200):
        try:
            with tokenizer_mod.template_budget(max_lines=limit):
                ok._hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
            lines.append(limit)
            break
        except tokenizer_mod.TemplateBudgetError:
            pass
    assert lines and lines[0] < 200


def test_42_5_template_wall_time_backstop(tmp_path, monkeypatch):
    """Few lines that each do much work in C (a 100,000-item list per loop step) hit the time limit."""
    import time

    import timlab.tokenizer as tokenizer_mod

    pytest.importorskip("transformers")
    tok = _templated(tmp_path / "heavy", "{% for i in range(99999) %}{% set x = range(99999)|list %}{% endfor %}")
    monkeypatch.setattr(tokenizer_mod, "TEMPLATE_MAX_SECONDS", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(tokenizer_mod.TemplateBudgetError, match=r"work budget \(more than 0.5 s\)"):
        tok.render_chat(MSGS)
    assert time.perf_counter() - t0 < 3


@pytest.mark.parametrize("template, chunks", [
    ("{% for i in range(99999) %}{{ 'x' * 3000 }}{% endfor %}", "many"),  # 3e8 characters, 10^5 lines
    ("{{ 'x' * 600000 }}", "one"),  # one chunk past the limit
])
def test_59_10_a_template_that_prints_past_the_output_limit_stops_before_the_tokenizer(tmp_path, template, chunks):
    """Issue 59, finding 10: a template printing ~3e8 characters rendered them all, then the
    tokenizer's native code aborted the process (exit 134). Output is counted as the template
    yields it: past TEMPLATE_MAX_CHARS (524,288) a one-line error, and nothing reaches the tokenizer."""
    import time

    import timlab.tokenizer as tokenizer_mod

    pytest.importorskip("transformers")
    assert tokenizer_mod.TEMPLATE_MAX_CHARS == 524_288
    at_limit = _templated(tmp_path / "ok", "{{ 'a' * 524288 }}")
    assert len(at_limit.render_chat(MSGS)) == 524_288  # (and transformers imported before the clock starts)
    tok = _templated(tmp_path / "big", template)
    t0 = time.perf_counter()
    with pytest.raises(tokenizer_mod.TemplateBudgetError) as e:
        tok.render_chat(MSGS)
    assert time.perf_counter() - t0 < 2
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("ran past its work budget (more than 524,288 characters of output) "
                                            "rendering one prompt: a prompt too long to tokenize")
