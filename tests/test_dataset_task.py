"""The dataset task: verifiers on hand-made strings, rewards, file formats and their errors, chat
templates with a BPE tokenizer.json, and the RL loop end to end on a random Qwen3 folder written by
transformers (guard at 0 every step, interrupted run resumed bit for bit)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from script_loader import load_script
from timlab.cli import main
from timlab.config import resolve
from timlab.errors import TimlabError
from timlab.tasks import VERIFIERS, Example, build_verifier, get_task, make_splits
from timlab.tasks.dataset import BUNDLED
from timlab.tasks.verifiers import last_boxed, normalize
from timlab.tokenizer import PLAIN_CHAT_SEP, load_tokenizer, save_char_tokenizer
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.run import RLRun, train

REPO = Path(__file__).resolve().parents[1]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ verifiers
def test_verifier_registry_names():
    assert VERIFIERS.names() == ["boxed", "exact", "last_number", "regex"]


def test_normalize_by_hand():
    assert normalize("  The   Answer.\n") == "the answer"
    assert normalize("Ｐａｒｉｓ") == "paris"  # NFKC folds full-width letters
    assert normalize("a.b.") == "a.b"
    assert normalize("") == ""


@pytest.mark.parametrize("name, completion, answer, expected", [
    ("exact", "Paris", "paris", True),
    ("exact", "  Paris. ", "Paris", True),
    ("exact", "Paris is", "Paris", False),
    ("exact", "   ", "Paris", False),
    ("last_number", "3 + 4 = 7, so the answer is 1,250 apples.", "1250", True),
    ("last_number", "It costs 3.50", "3.5", True),
    ("last_number", "-2", "-2.0", True),
    ("last_number", "12, no wait, 13", "12", False),
    ("last_number", "the total is 72", "Step 1 ... #### 72", True),
    ("last_number", "no digits here", "5", False),
    ("boxed", r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}", True),
    ("boxed", r"\boxed{a{b}c} then \boxed{x^{2}}", r"\boxed{x^{2}}", True),
    ("boxed", r"\boxed{ 1,000 }", "1000", True),
    ("boxed", r"\boxed{12", "12", False),
    ("boxed", "12", "12", False),
    ("boxed", r"\boxed{13}", r"the answer is \boxed{12}", False),
])
def test_verifiers_on_hand_made_strings(name, completion, answer, expected):
    assert build_verifier(name)(completion, answer) is expected


def test_boxed_extraction_by_hand():
    assert last_boxed(r"\boxed{1} and \boxed{{2}+{3}}") == "{2}+{3}"
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed("none") is None
    assert last_boxed(r"\boxed{1} \boxed{2") is None  # the last box is unclosed


def test_regex_verifier_takes_the_last_match_and_its_first_group():
    v = build_verifier("regex", pattern=r"Answer:\s*(\w+)")
    assert v.extract("Answer: foo ... Answer: Bar") == "Bar"
    assert v("Answer: foo ... Answer: Bar", "bar") and not v("Answer: foo", "bar")
    assert v.extract("nothing") is None
    whole = build_verifier("regex", pattern=r"\d+")
    assert whole.extract("1 then 22") == "22"


def test_42_4_a_catastrophic_regex_pattern_stops_in_bounded_time_with_one_line():
    """Finding 4: ``(a|aa)+b`` on 34 a's takes seconds in Python's re (doubling per 1.4 more a's);
    the verifier gives up after REGEX_TIMEOUT_S with an error naming the pattern."""
    import time

    from timlab.tasks.verifiers import REGEX_TIMEOUT_S

    v = build_verifier("regex", pattern=r"(a|aa)+b")
    t0 = time.perf_counter()
    with pytest.raises(TimlabError) as e:
        v.extract("a" * 34)
    took = time.perf_counter() - t0
    assert REGEX_TIMEOUT_S <= took < REGEX_TIMEOUT_S + 1.5, took
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("task.kwargs.pattern '(a|aa)+b' took over 0.5 s on a completion of 34")
    # the issue's own example no longer backtracks at all in this engine; ordinary patterns keep re's answers
    assert build_verifier("regex", pattern=r"(a+)+b").extract("a" * 40) is None
    assert build_verifier("regex", pattern=r"(a+)+b").extract("a" * 40 + "b") == "a" * 40


@pytest.mark.parametrize("pattern, size", [
    ("abc", 3), (r"\d{1,3}(,\d{3})*", 7), ("(a|bc){2}", 6), ("[a-z{}]{2,64}", 64), ("a{,5}", 5), ("a{5,}", 5),
    ("(ab)+", 2), (r"\p{L}{10}", 10), ("[]a]{3}", 3), ("x{abc}", 6), ("a{100000}", 100_000),
    ("((((a{100}){100}){100}){100})", 100_001), ("a{99999999999999999999}", 100_001),  # counted up to the limit
])
def test_59_7_regex_size_unrolls_counted_repeats(pattern, size):
    from timlab.tasks.verifiers import REGEX_MAX_SIZE, regex_size

    assert REGEX_MAX_SIZE == 100_000
    assert regex_size(pattern) == size


def test_59_7_a_pattern_whose_repeats_unroll_past_the_limit_is_refused_before_compiling():
    """Issue 59, finding 7: ``((((a{100}){100}){100}){100})`` made the compile allocate 3.4 GB; the
    time limit covers matching only. ``((a{1000}){1000})`` (10^6 atoms, about 300 MB and 0.4 s to
    compile unbounded) is refused at once; ``a{100000}``, at the limit, compiles."""
    import time

    for pattern in ("((a{1000}){1000})", "((((a{100}){100}){100}){100})"):
        t0 = time.perf_counter()
        with pytest.raises(TimlabError) as e:
            build_verifier("regex", pattern=pattern)
        assert time.perf_counter() - t0 < 0.05
        assert str(e.value).startswith(f"task.kwargs.pattern {pattern!r} repeats too much") and "100,000" in str(e.value)
    assert build_verifier("regex", pattern="a{100000}").extract("a" * 100_000) == "a" * 100_000


@pytest.mark.parametrize("kwargs, needle", [
    ({"name": "regex"}, "verifier 'regex' needs task.kwargs.pattern"),
    ({"name": "regex", "pattern": "(unclosed"}, "task.kwargs.pattern '(unclosed' is not a valid regular expression"),
    ({"name": "exact", "pattern": "x"}, "task.kwargs.pattern is only used by verifier 'regex', not 'exact'"),
    ({"name": "fuzzy"}, "unknown verifier 'fuzzy'; valid choices: boxed, exact, last_number, regex"),
])
def test_verifier_errors_are_one_line(kwargs, needle):
    kwargs = dict(kwargs)
    with pytest.raises(TimlabError) as e:  # UsageError, or UnknownNameError (a KeyError) for the name
        build_verifier(kwargs.pop("name"), **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ the task: rewards
def test_rewards_zero_one_and_format_reward(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"question": "q1", "answer": "1234"}, {"question": "q2", "answer": "7"}])
    ex = Example("q1", "1234")
    plain = get_task("dataset", path=str(f))
    assert [plain.reward(ex, c) for c in ("so 1,234", "1235", "none")] == [1.0, 0.0, 0.0]
    shaped = get_task("dataset", path=str(f), format_reward=0.25)
    assert [shaped.reward(ex, c) for c in ("so 1,234", "1235", "none")] == [1.0, 0.25, 0.0]
    # dense: positional match of the extracted answer where it beats the format reward
    assert shaped.reward(ex, "1235", dense=True) == 0.75  # 3 of 4 digits
    assert shaped.reward(ex, "9", dense=True) == 0.25
    boxed = get_task("dataset", path=str(f), verifier="boxed", format_reward=0.5)
    assert [boxed.reward(ex, c) for c in (r"\boxed{1234}", r"\boxed{5}", "1234")] == [1.0, 0.5, 0.0]


def test_bundled_word_problems_are_the_scripts_output():
    mod = load_script("make_word_problems")
    assert BUNDLED.read_text(encoding="utf-8") == mod.render(mod.word_problems())
    task = get_task("dataset")  # the bundled file is the default path
    rows = task.examples()
    assert len(rows) == 50 and len({e.prompt for e in rows}) == 50
    assert all(task.reward(e, f"The answer is {e.answer}.") == 1.0 for e in rows)
    assert all(e.answer.isdigit() for e in rows)


def test_jsonl_csv_and_parquet_give_the_same_examples(tmp_path):
    rows = [{"problem": "What is 2+2?", "solution": "4", "id": 1},
            {"problem": "Say hi, twice", "solution": "hi, hi", "id": 2},
            {"problem": "What is 2+2?", "solution": "5", "id": 3}]  # a repeated prompt: dropped
    df = pd.DataFrame(rows)
    paths = [_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.csv", tmp_path / "d.parquet"]
    df.to_csv(paths[1], index=False)
    df.to_parquet(paths[2])
    got = [get_task("dataset", path=str(p), prompt_key="problem", answer_key="solution", verifier="exact").examples()
           for p in paths]
    assert got[0] == [Example("What is 2+2?", "4"), Example("Say hi, twice", "hi, hi")]
    assert got[0] == got[1] == got[2]
    # numbers in the answer column are read as their text
    nums = get_task("dataset", path=str(_jsonl(tmp_path / "n.jsonl", [{"question": "q", "answer": 72}])))
    assert nums.examples() == [Example("q", "72")]


def test_splits_cut_the_shuffled_file(tmp_path):
    task = get_task("dataset")
    train_set, val = make_splits(task, seed=3, n_train=20000, n_val=10)
    assert (len(train_set), len(val)) == (40, 10)
    assert not {e.prompt for e in train_set} & {e.prompt for e in val}
    assert make_splits(task, seed=3, n_train=5, n_val=10) == (train_set[:5], val)  # n_train caps; val unchanged
    assert make_splits(task, seed=4, n_train=40, n_val=10)[1] != val
    with pytest.raises(ValueError, match="has 50 distinct prompts; n_val=50 must be between 1 and 49"):
        make_splits(task, seed=3, n_train=1, n_val=50)


def _bad_files(tmp_path: Path) -> list[tuple[dict, str]]:
    good = [{"question": "q", "answer": "1"}]
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    (tmp_path / "list.jsonl").write_text('["q", "1"]\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    (tmp_path / "d.txt").write_text("x")
    (tmp_path / "bad.parquet").write_text("not parquet")
    pd.DataFrame({"question": ["q", "r"], "answer": ["1", ""]}).to_csv(tmp_path / "gap.csv", index=False)
    _jsonl(tmp_path / "good.jsonl", good)
    _jsonl(tmp_path / "noanswer.jsonl", [{"question": "q", "answer": "1"}, {"question": "r"}])
    _jsonl(tmp_path / "nonnum.jsonl", [{"question": "q", "answer": "Paris"}])
    _jsonl(tmp_path / "listcell.jsonl", [{"question": ["q"], "answer": "1"}])
    g = str(tmp_path / "good.jsonl")
    return [
        ({"path": str(tmp_path / "nope.jsonl")}, "task.kwargs.path '{t}/nope.jsonl': no such file"),
        ({"path": str(tmp_path / "d.txt")}, "unknown file type '.txt'; valid choices: .csv, .jsonl, .parquet"),
        ({"path": str(tmp_path / "bad.jsonl")}, "{t}/bad.jsonl: line 2: invalid JSON"),
        ({"path": str(tmp_path / "list.jsonl")}, "{t}/list.jsonl: line 1: expected a JSON object, got a list"),
        ({"path": str(tmp_path / "empty.jsonl")}, "{t}/empty.jsonl: no rows"),
        ({"path": str(tmp_path / "latin1.jsonl")}, "{t}/latin1.jsonl: not UTF-8 text"),
        ({"path": str(tmp_path / "bad.parquet")}, "{t}/bad.parquet: cannot be read as PARQUET"),
        ({"path": str(tmp_path / "gap.csv")}, "{t}/gap.csv: row 3: 'answer' (task.kwargs.answer_key) is empty"),
        ({"path": str(tmp_path / "noanswer.jsonl")}, "line 2: 'answer' (task.kwargs.answer_key) is missing"),
        ({"path": str(tmp_path / "listcell.jsonl")}, "line 1: 'question' (task.kwargs.prompt_key) is a list, not text"),
        ({"path": g, "prompt_key": "problem"},
         "{t}/good.jsonl: no column 'problem' (task.kwargs.prompt_key); columns: answer, question"),
        ({"path": str(tmp_path / "nonnum.jsonl")},
         "{t}/nonnum.jsonl: line 1: reference answer 'Paris' has no number for verifier 'last_number'"),
        ({"path": g, "verifier": "fuzzy"}, "unknown task.kwargs.verifier 'fuzzy'; valid choices: boxed, exact, last_number, regex"),
        ({"path": g, "system_prompt": {"Answer": 42}}, "task.kwargs.system_prompt must be text, got a dict"),
        ({"path": g, "format_reward": 1.0}, "task.kwargs.format_reward must be a number in [0, 1), got 1.0"),
    ]


def test_bad_files_and_options_give_one_line_errors(tmp_path):
    for kwargs, needle in _bad_files(tmp_path):
        with pytest.raises(ValueError) as e:
            get_task("dataset", **kwargs)
        msg = str(e.value)
        assert needle.format(t=tmp_path) in msg, (kwargs, msg)
        assert "\n" not in msg


def test_42_6_a_huge_jsonl_line_or_prompt_is_refused_at_once(tmp_path):
    """Finding 6: a 20 MB one-line prompt is refused while reading (one line naming the file and
    line), after reading no more than the line limit; a prompt over the text limit likewise."""
    import time

    from timlab.tasks.dataset import MAX_LINE_BYTES, MAX_TEXT_CHARS

    assert (MAX_LINE_BYTES, MAX_TEXT_CHARS) == (1_048_576, 131_072)
    huge = tmp_path / "huge.jsonl"
    with huge.open("w") as f:
        f.write('{"question": "q", "answer": "1"}\n')
        f.write(json.dumps({"question": "x" * 20_000_000 + " 3", "answer": "3"}) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(TimlabError) as e:
        get_task("dataset", path=str(huge))
    assert time.perf_counter() - t0 < 2
    assert str(e.value) == f"{huge}: line 2: longer than 1,048,576 bytes (the limit for a JSONL line)"
    long = _jsonl(tmp_path / "long.jsonl", [{"question": "y" * (MAX_TEXT_CHARS + 1), "answer": "1"}])
    with pytest.raises(TimlabError, match=r"long.jsonl: line 1: 'question' \(task.kwargs.prompt_key\) has "
                                          r"131,073 characters; the limit is 131,072$"):
        get_task("dataset", path=str(long))
    edge = _jsonl(tmp_path / "edge.jsonl", [{"question": "y" * MAX_TEXT_CHARS, "answer": "1"}])
    assert len(get_task("dataset", path=str(edge)).examples()[0].prompt) == MAX_TEXT_CHARS  # the limit itself is fine
    with pytest.raises(TimlabError, match="system_prompt has 131,073 characters; the limit is 131,072"):
        get_task("dataset", path=str(edge), system_prompt="s" * (MAX_TEXT_CHARS + 1))


def test_42_11_deep_json_and_lone_surrogates_are_one_line_errors(tmp_path):
    """Finding 11: an answer nested 100,000 arrays deep (a RecursionError in json) and a prompt with
    a lone surrogate (which the tokenizer cannot encode) are refused while reading."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"question": "q", "answer": "1"}\n{"question": "r", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(TimlabError) as e:
        get_task("dataset", path=str(deep))
    assert str(e.value) == f"{deep}: line 2: JSON nested too deeply to read"
    sur = tmp_path / "sur.jsonl"
    sur.write_text('{"question": "ab\\ud800c=", "answer": "1"}\n')
    assert json.loads(sur.read_text())["question"] == "ab\ud800c="
    with pytest.raises(TimlabError) as e:
        get_task("dataset", path=str(sur))
    assert str(e.value) == (f"{sur}: line 1: 'question' (task.kwargs.prompt_key) is not valid Unicode text "
                            "(a lone surrogate '\\ud800' at character 2)")
    good = _jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(TimlabError, match="system_prompt is not valid Unicode text"):
        get_task("dataset", path=str(good), system_prompt="hi\udfff")


def test_42_13_a_csv_row_with_more_or_fewer_fields_than_the_header_is_refused(tmp_path):
    """Finding 13: pandas read ``abc0=,1,5,7`` under ``question,answer`` as prompt '5', answer '7'."""
    more = tmp_path / "more.csv"
    more.write_text("question,answer\nabc0=,1,5,7\nq2,3\n")
    with pytest.raises(TimlabError) as e:
        get_task("dataset", path=str(more))
    assert str(e.value) == (f"{more}: row 2: 4 fields, but the header has 2 (question, answer); "
                            "quote a field that holds a comma")
    fewer = tmp_path / "fewer.csv"
    fewer.write_text("question,answer\nq1,1\nq2\n")
    with pytest.raises(TimlabError, match="fewer.csv: row 3: 1 fields, but the header has 2"):
        get_task("dataset", path=str(fewer))
    ok = tmp_path / "ok.csv"
    ok.write_text('\ufeffquestion,answer\r\n"abc0=,1",5\r\n\r\n"two\nlines",7\r\n')  # BOM, CRLF, quotes, a blank line
    task = get_task("dataset", path=str(ok))
    assert [(e.prompt, e.answer) for e in task.examples()] == [("abc0=,1", "5"), ("two\nlines", "7")]
    big = tmp_path / "big.csv"
    big.write_text("question,answer\n" + "z" * 200_000 + ",1\n")
    with pytest.raises(TimlabError, match="big.csv: line 2: a cell longer than 131,072 characters"):
        get_task("dataset", path=str(big))


def test_42_14_float32_parquet_answers_read_as_their_shortest_decimal(tmp_path):
    """Finding 14: a float32 cell 1.1 was the reference '1.100000023841858', so a correct '1.1' scored 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "f32.parquet"
    pq.write_table(pa.table({"question": ["a", "b", "c"],
                             "answer": pa.array([1.1, 0.3, 2.5], pa.float32()),
                             "half": pa.array([1.1, None, 3.0], pa.float16())}), f)
    task = get_task("dataset", path=str(f), verifier="exact")
    assert [e.answer for e in task.examples()] == ["1.1", "0.3", "2.5"]
    ex = task.examples()[0]
    assert task.reward(ex, "1.1") == 1.0 and task.reward(ex, "1.100000023841858") == 0.0
    with pytest.raises(TimlabError, match=r"row 2: 'half' \(task.kwargs.answer_key\) is missing"):
        get_task("dataset", path=str(f), answer_key="half", verifier="exact")  # a null float16 cell
    pq.write_table(pa.table({"question": ["a"], "half": pa.array([1.1], pa.float16())}), f)
    assert get_task("dataset", path=str(f), answer_key="half", verifier="exact").examples()[0].answer == "1.1"


def _repeated_parquet(path: Path, n: int, question: str) -> Path:
    """``n`` rows of the same question (and answer 3), dictionary-encoded: a small file."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    idx = pa.array(np.zeros(n, dtype=np.int32))
    pq.write_table(pa.table({"question": pa.DictionaryArray.from_arrays(idx, pa.array([question])),
                             "answer": pa.DictionaryArray.from_arrays(idx, pa.array(["3"]))}), path)
    return path


def test_59_8_a_parquet_file_past_the_row_limit_is_refused_from_its_metadata(tmp_path):
    """Issue 59, finding 8: 60 million repeated rows in 416 KB were read whole (2 GB) before any
    limit applied. The row count comes from the metadata: MAX_ROWS + 1 rows are refused at once."""
    import time

    from timlab.tasks.dataset import MAX_ROWS

    assert MAX_ROWS == 1_000_000
    f = _repeated_parquet(tmp_path / "many.parquet", MAX_ROWS + 1, "What is 1+2?")
    assert f.stat().st_size < 100_000
    t0 = time.perf_counter()
    with pytest.raises(TimlabError, match=rf"many.parquet: 1,000,001 rows; the limit for a dataset file is "
                                          rf"1,000,000 rows"):
        get_task("dataset", path=str(f))
    assert time.perf_counter() - t0 < 0.5
    g = _jsonl(tmp_path / "many.jsonl", [{"question": f"q{i}", "answer": "1"} for i in range(3)])
    import timlab.tasks.dataset as dataset

    with pytest.MonkeyPatch.context() as mp:  # the same limit, counted while reading, for JSONL and CSV
        mp.setattr(dataset, "MAX_ROWS", 2)
        with pytest.raises(TimlabError, match="many.jsonl: more than 2 rows; the limit for a dataset file is 2 rows"):
            get_task("dataset", path=str(g))


def test_59_8_parquet_text_is_counted_a_batch_at_a_time_before_it_becomes_python_text(tmp_path, monkeypatch):
    """Dictionary-encoded repeats decode to many times the file's size: the characters of the prompt
    and answer columns are counted per batch of PARQUET_BATCH_ROWS rows against MAX_PARQUET_CHARS
    (here 10,000), so the read stops in the batch that crosses it (100 characters x 256 rows + 256
    answers = 25,856 characters in the first), not at the file's end."""
    import timlab.tasks.dataset as dataset

    assert dataset.MAX_PARQUET_CHARS == 1 << 28 and dataset.PARQUET_BATCH_ROWS == 256
    monkeypatch.setattr(dataset, "MAX_PARQUET_CHARS", 10_000)
    f = _repeated_parquet(tmp_path / "wide.parquet", 100_000, "x" * 99 + "?")
    with pytest.raises(TimlabError, match=r"wide.parquet: the columns 'question', 'answer' hold more than 10,000 "
                                          r"characters by row 256 \(the limit for a Parquet file's prompts and answers\)"):
        get_task("dataset", path=str(f))
    monkeypatch.setattr(dataset, "MAX_PARQUET_CHARS", 100_000 * 101)  # at the limit: read, the repeats dropped
    assert [e.prompt for e in get_task("dataset", path=str(f)).examples()] == ["x" * 99 + "?"]


def test_bad_file_through_the_cli_is_one_line(tmp_path, capsys, tiny_qwen3):
    args = ["train", "--run-dir", str(tmp_path / "r"), "--quiet", "--set", "task.name=dataset",
            "--set", f"model.path={tiny_qwen3}", "--set", f"task.kwargs.path={tmp_path / 'missing.csv'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"timlab: error: task.kwargs.path '{tmp_path / 'missing.csv'}': no such file"


def test_dataset_task_needs_a_model_folder(tmp_path):
    cfg = resolve(overrides=["task.name=dataset", "task.n_val=8"])
    with pytest.raises(ValueError, match="task 'dataset' starts from a model folder of yours: set model.path"):
        train(cfg, tmp_path / "r")


# ------------------------------------------------------------------------------ tokenizer + chat template
@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random Qwen3 folder written by transformers: BPE tokenizer.json and a ChatML template."""
    pytest.importorskip("transformers")
    return load_script("make_tiny_chat_model").make_tiny_chat_model(tmp_path_factory.mktemp("qwen3") / "m")


def test_chat_template_prompt_matches_transformers(tiny_qwen3):
    import transformers

    tok = load_tokenizer(tiny_qwen3)
    assert tok.chat_template is not None and tok.eos_token_id == tok.token_to_id("<|im_end|>")
    task = get_task("dataset", system_prompt="Think, then give the number.")
    ex = task.examples()[0]
    ids = task.encode_prompt(tok, ex)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_qwen3))
    out = hf.apply_chat_template(task.messages(ex), tokenize=True, add_generation_prompt=True)
    assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nThink, then give the number.<|im_end|>\n"
                    f"<|im_start|>user\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) < len(text) // 2  # BPE merges, not one token per character


def test_plain_format_without_a_chat_template(tiny_qwen3, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(tiny_qwen3, folder)
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(folder)
    assert tok.chat_template is None
    ex = Example("What is 2+2?", "4")
    with_system = get_task("dataset", system_prompt="Be brief.")
    assert tok.decode(with_system.encode_prompt(tok, ex)) == "Be brief." + PLAIN_CHAT_SEP + "What is 2+2?"
    assert get_task("dataset").encode_prompt(tok, ex) == tok.encode("What is 2+2?")
    save_char_tokenizer("abc", tmp_path / "char")
    assert load_tokenizer(tmp_path / "char").chat_template is None


def test_long_prompts_and_answers_with_a_bpe_tokenizer(tiny_qwen3, tmp_path):
    tok = load_tokenizer(tiny_qwen3)
    prompt = " ".join(f"Step {i}: add {i} apples to the basket." for i in range(60))
    answer = " ".join(f"{i} plus {i + 1} is {2 * i + 1}." for i in range(400)) + r" So \boxed{80200}."
    f = _jsonl(tmp_path / "long.jsonl", [{"question": prompt, "answer": answer}, {"question": "short", "answer": "1"}])
    task = get_task("dataset", path=str(f), verifier="boxed")
    ex = task.examples()[0]
    ids = task.encode_prompt(tok, ex)
    answer_ids = tok.encode(answer)
    assert len(ids) > 300 and len(answer_ids) > 3000
    assert tok.decode(answer_ids) == answer  # byte-level BPE round-trips exactly
    assert task.reward(ex, tok.decode(answer_ids)) == 1.0
    assert task.reward(ex, answer.replace("80200", "80201")) == 0.0
    assert task.max_answer_chars == len(answer)


# ------------------------------------------------------------------------------ RL end to end
def _rl_config(model: Path, **extra):
    sets = {
        "model.path": str(model), "task.name": "dataset", "task.kwargs.system_prompt": "Give the number.",
        "task.kwargs.format_reward": 0.5, "task.n_val": 4, "rollout.prompts_per_step": 3,
        "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": 12, "optim.lr": 3e-3,
        "run.steps": 4, "run.eval_every": 4, "run.checkpoint_every": 2, "run.progress": False, **extra,
    }
    return resolve(overrides=[f"{k}={v}" for k, v in sets.items()])


def _metrics(run_dir: Path) -> pd.DataFrame:
    return without_timings(pd.read_parquet(run_dir / "metrics.parquet"))


def _weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


class _Interrupt(Exception):
    pass


def test_rl_on_the_word_problems_guard_zero_and_resume_bitwise(tiny_qwen3, tmp_path):
    cfg = _rl_config(tiny_qwen3)
    ref = tmp_path / "ref"
    train(cfg, ref)
    df = _metrics(ref)
    steps = df[df["step"] > 0]
    assert steps["step"].tolist() == [1, 2, 3, 4]
    # the zero-mismatch guard held (it raises otherwise) and the metrics say so on every step
    assert (steps["mismatch/max_abs_diff"] == 0).all() and (steps["mismatch/frac_bitwise_equal"] == 1).all()
    assert steps["train/updated"].sum() >= 1, "no step updated the weights: the resume check would be vacuous"
    halves = steps["train/reward_mean"] * 24  # 12 sequences with rewards in {0, 0.5, 1}: whole halves
    assert ((halves - halves.round()).abs() < 1e-4).all() and (halves > 0).any()
    print(steps[["step", "train/reward_mean", "train/updated", "train/response_length_mean"]].to_string())
    assert df["val/accuracy"].notna().sum() == 2  # steps 0 and 4
    latest = ref / "checkpoints" / (ref / "checkpoints" / "latest").read_text().strip()
    assert (latest / "chat_template.jinja").exists()  # checkpoints keep the chat template

    # interrupted after step 3 (logged; the last checkpoint is step 2), then resumed by the CLI
    cut = tmp_path / "cut"

    def stop_after_3(phase, step, total, row):
        if phase == "train" and step == 3:
            raise _Interrupt

    run = RLRun(cfg, cut, progress=stop_after_3)
    with pytest.raises(_Interrupt):
        run.run()
    assert _metrics(cut)["step"].max() == 3
    assert main(["train", "--run-dir", str(cut), "--resume", "--quiet"]) == 0
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(cut), check_exact=True)
    wr, wc = _weights(ref), _weights(cut)
    assert wr.keys() == wc.keys() and all(torch.equal(wr[k], wc[k]) for k in wr)
