"""Tests for timlab.tasks: seeding, splits, rewards (exact, dense, countdown verifier), lengths."""

import random

import pytest

from timlab.tasks import (
    TASKS,
    Example,
    evaluate_expression,
    get_task,
    make_splits,
    parse_prompt,
    positional_match,
)
from timlab.registry import UnknownNameError

ALL_TASKS = ["addition", "copy", "countdown", "reverse", "scratch_add", "sort"]  # the generators
DATASET_TASKS = ["dataset"]  # rows of a file: tests/test_dataset_task.py
STRING_TASKS = ["addition", "copy", "reverse", "sort"]  # a single correct answer


def test_registry_names_and_unknown_name():
    assert TASKS.names() == sorted(ALL_TASKS + DATASET_TASKS)
    with pytest.raises(UnknownNameError, match="valid choices: addition, copy, countdown"):
        get_task("revers")


def test_bad_option_names_key_and_valid_keys():
    expected = r"no option 'foo'; valid options: min_len, max_len, charset"
    with pytest.raises(TypeError, match=expected):
        get_task("reverse", foo=1)
    with pytest.raises(TypeError, match="valid options: min_numbers, max_numbers, max_value"):
        get_task("countdown", min_len=3)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        get_task("sort", min_len=9, max_len=3)
    with pytest.raises(ValueError, match="max_digits <= 39"):
        get_task("addition", max_digits=40)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_same_seed_same_examples_different_seed_different(name):
    task = get_task(name)
    a = task.sample(random.Random(123), 50)
    b = task.sample(random.Random(123), 50)
    c = task.sample(random.Random(124), 50)
    assert a == b
    assert len(a) == 50 and all(isinstance(e, Example) for e in a)
    assert sum(x != y for x, y in zip(a, c)) >= 45


@pytest.mark.parametrize("name", ALL_TASKS)
def test_splits_sized_disjoint_and_seeded(name):
    task = get_task(name)
    train, val = make_splits(task, seed=7, n_train=300, n_val=100)
    assert (len(train), len(val)) == (300, 100)
    train_prompts, val_prompts = {e.prompt for e in train}, {e.prompt for e in val}
    assert len(train_prompts) == 300 and len(val_prompts) == 100  # no repeats inside a split
    assert not train_prompts & val_prompts
    assert make_splits(task, seed=7, n_train=300, n_val=100) == (train, val)
    assert make_splits(task, seed=8, n_train=300, n_val=100)[1] != val
    assert make_splits(task, seed=7, n_train=10, n_val=100)[1] == val  # val ignores n_train


def test_splits_raise_when_the_task_is_too_small():
    tiny = get_task("copy", min_len=1, max_len=1, charset="ab")  # only 2 distinct prompts
    assert len(make_splits(tiny, seed=0, n_train=1, n_val=1)[0]) == 1
    with pytest.raises(ValueError, match="gave only 1 distinct new prompts"):
        make_splits(tiny, seed=0, n_train=2, n_val=1)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_examples_fit_alphabet_and_bounds(name):
    task = get_task(name)
    exs = task.sample(random.Random(0), 500)
    alphabet = set(task.alphabet)
    assert task.alphabet == "".join(sorted(alphabet))
    assert "<" not in alphabet  # keeps "<eos>" & co. out of task text
    for e in exs:
        assert set(e.prompt) <= alphabet and set(e.answer) <= alphabet
        assert len(e.prompt) <= task.max_prompt_chars and len(e.answer) <= task.max_answer_chars
        assert e.prompt.endswith("=")


# task -> (min, max) answer length over 2000 samples at seed 0; documented ranges in brackets
MEASURED_ANSWER_LENGTHS = {
    "addition": (2, 15),  # [min_digits, max_digits + 1] = [2, 15]
    "copy": (4, 24),  # [min_len, max_len]
    "reverse": (4, 24),
    "sort": (4, 24),
    "countdown": (3, 20),  # [3, max_answer_chars = 20]
}


@pytest.mark.parametrize("name", sorted(MEASURED_ANSWER_LENGTHS))
def test_answer_length_distribution(name):
    task = get_task(name)
    lengths = [len(e.answer) for e in task.sample(random.Random(0), 2000)]
    assert (min(lengths), max(lengths)) == MEASURED_ANSWER_LENGTHS[name]
    assert max(lengths) <= task.max_answer_chars
    assert len(set(lengths)) >= 12  # spread out, not a few lengths
    assert max(lengths.count(n) for n in set(lengths)) < 0.4 * len(lengths)


def test_answer_lengths_configurable_up_to_40():
    rev = get_task("reverse", min_len=30, max_len=40)
    add = get_task("addition", min_digits=38, max_digits=39)
    assert {len(e.answer) for e in rev.sample(random.Random(0), 400)} == set(range(30, 41))
    add_lengths = {len(e.answer) for e in add.sample(random.Random(0), 400)}
    assert min(add_lengths) == 38 and max(add_lengths) == 40
    assert (rev.max_answer_chars, add.max_answer_chars) == (40, 40)


def test_string_task_answers_by_hand():
    rev, srt, cpy, add = (get_task(n) for n in ("reverse", "sort", "copy", "addition"))
    e = rev.sample_one(random.Random(0))
    assert e.prompt[:4] == "rev:" and e.answer == e.prompt[4:-1][::-1]
    e = srt.sample_one(random.Random(0))
    assert e.answer == "".join(sorted(e.prompt[5:-1]))
    e = cpy.sample_one(random.Random(0))
    assert e.answer == e.prompt[5:-1]
    for e in add.sample(random.Random(0), 200):
        a, b = e.prompt[4:-1].split("+")
        assert int(e.answer) == int(a) + int(b)
        assert a[0] != "0" and b[0] != "0"


@pytest.mark.parametrize("name", STRING_TASKS)
def test_exact_match_reward(name):
    task = get_task(name)
    for e in task.sample(random.Random(1), 100):
        assert task.reward(e, e.answer) == 1.0
        last = e.answer[-1]
        other = "0" if last != "0" else "1"
        assert task.reward(e, e.answer[:-1] + other) == 0.0
        assert task.reward(e, e.answer + last) == 0.0  # too long
        assert task.reward(e, e.answer[:-1]) == 0.0  # too short
        assert task.reward(e, e.answer, dense=True) == 1.0


def test_positional_match_by_hand():
    assert positional_match("abcd", "abcd") == 1.0
    assert positional_match("abxd", "abcd") == 0.75
    assert positional_match("abc", "abcd") == 0.75
    assert positional_match("abcde", "abcd") == 0.8
    assert positional_match("", "abcd") == 0.0
    assert positional_match("bcd", "abcd") == 0.0  # left-aligned: a shift scores nothing
    assert positional_match("", "") == 1.0


def test_dense_reward_by_hand():
    rev = get_task("reverse")
    e = Example("rev:abcd=", "dcba")
    assert [rev.reward(e, c, dense=True) for c in ("dcba", "dcbx", "dcb", "dcbaa", "")] == [
        1.0, 0.75, 0.75, 0.8, 0.0]
    assert rev.reward(e, "dcbx") == 0.0
    add = get_task("addition")
    e = Example("add:12+34=", "46")
    assert [add.reward(e, c, dense=True) for c in ("46", "47", "4", "460", "64")] == [
        1.0, 0.5, 0.5, pytest.approx(2 / 3), 0.0]


# ---- countdown ----


def test_countdown_reference_answers_verify():
    for division in (False, True):
        task = get_task("countdown", division=division)
        exs = task.sample(random.Random(3), 1000)
        assert sum("/" in e.answer for e in exs) == (0 if not division else 34)
        for e in exs:
            numbers, target = parse_prompt(e.prompt)
            assert 3 <= len(numbers) <= 5 and all(1 <= n <= 99 for n in numbers)
            assert 1 <= target <= 999
            assert evaluate_expression(e.answer, numbers, division=division) == target
            assert task.reward(e, e.answer) == 1.0


def test_countdown_prompt_format():
    e = get_task("countdown").sample_one(random.Random(0))
    assert e == Example("cd:98,54,6,34>324=", "54*6")
    assert parse_prompt("cd:3,7,25,50>75=") == ([3, 7, 25, 50], 75)
    with pytest.raises(ValueError, match="not a countdown prompt"):
        parse_prompt("rev:abc=")


CD = Example("cd:3,7,25,50>75=", "50+25")


@pytest.mark.parametrize("completion", [
    "50+25", "25+50", "3*25", "25*3", "(50+25)", " 25 + 50 ", "((50))+25", "(50-25)*3",
    "3*(50-25)",
])
def test_countdown_accepts_correct_expressions(completion):
    task = get_task("countdown")
    assert task.reward(CD, completion) == 1.0
    assert task.reward(CD, completion, dense=True) == 1.0


def test_countdown_counts_numbers_as_a_multiset():
    task = get_task("countdown")
    assert evaluate_expression("(7-3)*25-50+25", [3, 7, 25, 50]) is None  # 25 used twice
    assert evaluate_expression("(7-3)*25-50", [3, 7, 25, 50]) == 50
    e = Example("cd:2,2,5>9=", "2*2+5")
    assert task.reward(e, "2*2+5") == 1.0 and task.reward(e, "5+2+2") == 1.0  # 2 given twice
    assert task.reward(e, "5+2+2+2") == 0.0
    assert task.reward(e, "9") == 0.0  # not a given number


@pytest.mark.parametrize("completion", [
    "50+7",  # wrong value
    "25+25+25",  # reuse of a number
    "70+5",  # unknown numbers
    "050+25",  # leading zero
    "50-(-25)", "-3+78",  # unary minus
    "50+25+", "(50+25", "50+25)", "()", "", "+", "50 25", "5 0+25",
    "__import__('os')", "__import__('os').system('ls')", "eval('50+25')", "50+25;import os",
    "50+25\n", "1e2-25", "0x32+25", "50+25 # x", "3**3", "50.0+25", "75=75", "（50+25）",
    "٥0+25",  # a non-ASCII digit
])
def test_countdown_rejects(completion):
    task = get_task("countdown")
    assert task.reward(CD, completion) == 0.0
    if completion != "50+7":
        assert task.reward(CD, completion, dense=True) == 0.0


def test_countdown_dense_by_hand():
    task = get_task("countdown")
    assert task.reward(CD, "50+25", dense=True) == 1.0
    assert task.reward(CD, "50+7", dense=True) == pytest.approx(0.5 * (1 - 18 / 75))  # 0.38
    assert task.reward(CD, "50*3", dense=True) == 0.0  # 150 is 75 away: no credit
    assert task.reward(CD, "3-7", dense=True) == 0.0  # negative value
    assert task.reward(CD, "50+7+", dense=True) == 0.0  # invalid


def test_countdown_division_exact_only():
    assert evaluate_expression("6*12/4", [6, 4, 12], division=True) == 18
    assert evaluate_expression("6*12/4", [6, 4, 12], division=False) is None
    assert evaluate_expression("7/2", [7, 2], division=True) is None  # not exact
    assert evaluate_expression("6/(4-4)", [6, 4, 4], division=True) is None  # by zero
    task = get_task("countdown", division=True)
    assert task.reward(Example("cd:6,4,12>18=", "6*12/4"), "12/4*6") == 1.0
    assert "/" in task.alphabet and "/" not in get_task("countdown").alphabet


def test_countdown_rejects_long_and_deep_inputs():
    nums = [3, 7, 25, 50]
    assert evaluate_expression("(" * 16 + "3" + ")" * 16, nums) == 3
    assert evaluate_expression("(" * 17 + "3" + ")" * 17, nums) is None  # deeper than 16
    assert evaluate_expression("(" * 100_000 + "3" + ")" * 100_000, nums) is None
    assert evaluate_expression("3+" * 5000 + "7", nums) is None
    assert evaluate_expression("9" * 300, [int("9" * 300)]) is None  # over 256 characters
    assert get_task("countdown").reward(CD, "50+25" + " " * 300) == 0.0


def test_scratch_add_scratchpad_by_hand():
    from timlab.tasks.scratchpad import final_answer, scratchpad, used_scratchpad
    # 47 + 85: 7+5+0 = 12 -> digit 2 carry 1; 4+8+1 = 13 -> digit 3 carry 1; final carry -> 132
    assert scratchpad(47, 85) == ":7502,4813,"
    assert scratchpad(5, 998) == ":5803,0910,0910,"  # a short operand reads as 0
    assert scratchpad(0, 0) == ":0000,"
    assert final_answer(":7502,4813,>132") == "132" and final_answer(">7>132") == "132"
    assert final_answer("132") is None
    assert used_scratchpad(":7502,>1") and not used_scratchpad(">132")


def test_scratch_add_rewards_only_the_final_answer():
    task = get_task("scratch_add")
    ex = Example("47+85=", "132")
    assert task.reward(ex, ">132") == 1.0
    assert task.reward(ex, ":7502,4813,>132") == 1.0
    assert task.reward(ex, ":garbage>132") == 1.0  # the working is not checked
    assert task.reward(ex, "132") == 0.0  # no answer mark
    assert task.reward(ex, ">133") == 0.0
    assert task.reward(ex, ">13", dense=True) == pytest.approx(2 / 3)


def test_scratch_add_demonstrations_mix_and_bound():
    task = get_task("scratch_add", max_digits=6, scratch_frac=0.25)
    rng = random.Random(0)
    exs = task.sample(random.Random(1), 2000)
    demos = [task.demonstration(e, rng) for e in exs]
    scratch = [d for d in demos if d.startswith(":")]
    assert abs(len(scratch) / len(demos) - 0.25) < 0.03
    for e, d in zip(exs, demos):
        assert task.reward(e, d) == 1.0 and len(d) <= task.max_answer_chars and set(d) <= set(task.alphabet)
    # the worked form is several times longer: the room a response-length surge needs
    mean = lambda xs: sum(map(len, xs)) / len(xs)  # noqa: E731
    assert mean(scratch) > 4 * mean([d for d in demos if not d.startswith(":")])
    # tasks without worked solutions demonstrate the answer and draw nothing
    state = rng.getstate()
    assert get_task("reverse").demonstration(Example("rev:ab=", "ba"), rng) == "ba"
    assert rng.getstate() == state


def test_scratch_add_verbosity_by_hand():
    from timlab.tasks.scratchpad import scratchpad
    # level 0 is today's form; level 1 copies the zero-padded operands and pads each unit to 14
    # characters with its own digits, cyclically
    assert scratchpad(47, 85, 0) == scratchpad(47, 85) == ":7502,4813,"
    assert scratchpad(47, 85, 1) == ":47+85=" + "75027502750275," + "48134813481348,"
    assert scratchpad(5, 998, 1) == ":005+998=" + "58035803580358," + "09100910091009," * 2
    assert scratchpad(0, 0, 2) == ":0+0=" + "0" * 42 + ","
    assert len(scratchpad(47, 85, 3)) == 1 + 6 + 2 * (4 + 87 + 1)


def test_scratch_add_verbosity_zero_is_todays_task_bit_for_bit():
    """The same examples, the same demonstrations from the same rng draws, the same bounds."""
    old, new = get_task("scratch_add", max_digits=4, scratch_frac=0.2), get_task("scratch_add", max_digits=4,
                                                                               scratch_frac=0.2, verbosity=0)
    exs = old.sample(random.Random(3), 300)
    assert new.sample(random.Random(3), 300) == exs
    ra, rb = random.Random(4), random.Random(4)
    demos = [new.demonstration(e, rb) for e in exs]
    assert demos == [old.demonstration(e, ra) for e in exs] and ra.getstate() == rb.getstate()
    assert demos[:3] == [">142", ":3700,7018,0000,2002,>2080", ">698"]  # frozen: today's demonstrations
    assert (new.alphabet, new.max_prompt_chars, new.max_answer_chars) == ("+,0123456789:=>", 10, 27)


@pytest.mark.parametrize("verbosity, mean_len", [(0, 21.932), (1, 61.474), (2, 149.072), (3, 302.3685)])
def test_scratch_add_verbosity_lengthens_the_answer_at_fixed_difficulty(verbosity, mean_len):
    """Mean worked-answer length (tokens: characters + EOS) at 1-4-digit sums ~20/60/150/300; the
    sums, the answers and the rewards do not change, and every demonstration is rewarded 1."""
    task = get_task("scratch_add", max_digits=4, scratch_frac=1.0, verbosity=verbosity)
    exs = task.sample(random.Random(0), 2000)
    assert exs == get_task("scratch_add", max_digits=4).sample(random.Random(0), 2000)  # the same sums
    demos = [task.demonstration(e, random.Random(0)) for e in exs]
    assert sum(len(d) + 1 for d in demos) / len(demos) == pytest.approx(mean_len, abs=1e-9)
    for e, d in zip(exs, demos):
        assert task.reward(e, d) == 1.0 and task.reward(e, d, dense=True) == 1.0
        assert task.reward(e, d[: d.rindex(">") + 1] + "0") == (e.answer == "0")  # a wrong sum scores 0
        assert len(d) <= task.max_answer_chars and set(d) <= set(task.alphabet)
    assert max(len(d) for d in demos) == task.max_answer_chars  # the bound is tight


@pytest.mark.parametrize("kwargs", [{"max_digits": 21}, {"min_digits": 0}, {"scratch_frac": 1.5}, {"verbosity": 4},
                                    {"verbosity": -1}, {"verbosity": 1.5}])
def test_scratch_add_rejects_bad_options(kwargs):
    with pytest.raises(ValueError, match="scratch_add"):
        get_task("scratch_add", **kwargs)


def test_scratch_add_restate_by_hand():
    from timlab.tasks.scratchpad import countdown_label, restatement, used_scratchpad
    assert [countdown_label(i) for i in (0, 1, 25, 26, 27, 675)] == ["aa", "ab", "az", "ba", "bb", "zz"]
    assert restatement(47, 85, 0) == ""
    assert restatement(47, 85, 3) == "ac47+85=ab47+85=aa47+85="
    task = get_task("scratch_add", scratch_frac=1.0, restate=3)
    ex = Example("47+85=", "132")
    gold = "ac47+85=ab47+85=aa47+85=:7502,4813,>132"
    assert task.gold_completion(ex) == gold and task.demonstration(ex, random.Random(0)) == gold
    assert task.reward(ex, gold) == 1.0 and used_scratchpad(gold) and not used_scratchpad(">132")
    # the terse form does not change; the letters join the alphabet only when restate > 0
    assert get_task("scratch_add", scratch_frac=0.0, restate=3).demonstration(ex, random.Random(0)) == ">132"
    assert get_task("scratch_add", restate=3).alphabet == "+,0123456789:=>abcdefghijklmnopqrstuvwxyz"
    assert get_task("scratch_add", restate=0).alphabet == "+,0123456789:=>"


@pytest.mark.parametrize("restate, mean_len", [(0, 21.932), (1, 30.947), (31, 301.397), (109, 1004.567)])
def test_scratch_add_restate_lengthens_the_answer_with_the_same_decisions(restate, mean_len):
    """T ~ 30, 300 and 1,000 (tokens: characters + EOS) at 1-4-digit sums; the sums are the same, and
    after the restated operands every demonstration is level 0's worked answer character for
    character: the same decision tokens at every length."""
    from timlab.tasks.scratchpad import countdown_label
    task = get_task("scratch_add", max_digits=4, scratch_frac=1.0, restate=restate)
    level0 = get_task("scratch_add", max_digits=4, scratch_frac=1.0)
    exs = task.sample(random.Random(0), 2000)
    assert exs == level0.sample(random.Random(0), 2000)
    demos = [task.demonstration(e, random.Random(0)) for e in exs]
    assert sum(len(d) + 1 for d in demos) / len(demos) == pytest.approx(mean_len, abs=1e-9)
    for e, d in zip(exs, demos):
        entry = 2 + len(e.prompt)  # a label and the prompt's operands
        worked = level0.gold_completion(e)
        assert d == "".join(countdown_label(i) + e.prompt for i in range(restate - 1, -1, -1)) + worked
        assert len(d) == restate * entry + len(worked)
        assert task.reward(e, d) == 1.0 and len(d) <= task.max_answer_chars and set(d) <= set(task.alphabet)
    assert max(len(d) for d in demos) == task.max_answer_chars  # the bound is tight


def test_scratch_add_restate_after_by_hand():
    """restate_at=after: the same restatement after the final answer, behind a ';' the reward stops at."""
    task = get_task("scratch_add", scratch_frac=1.0, restate=3, restate_at="after")
    ex = Example("47+85=", "132")
    gold = ":7502,4813,>132;ac47+85=ab47+85=aa47+85="
    assert task.gold_completion(ex) == gold and task.demonstration(ex, random.Random(0)) == gold
    assert task.reward(ex, gold) == 1.0 and task.reward(ex, gold, dense=True) == 1.0
    assert task.reward(ex, ":7502,4813,>132") == 1.0  # the filler is never checked, like the scratchpad
    assert task.reward(ex, ":7502,4813,>133;ac47+85=") == 0.0 and task.reward(ex, ">13;2") == 0.0
    assert task.alphabet == "+,0123456789:;=>abcdefghijklmnopqrstuvwxyz"
    # without a restatement there is nothing to place: the form and the alphabet are restate 0's
    plain = get_task("scratch_add", scratch_frac=1.0, restate_at="after")
    assert plain.gold_completion(ex) == ":7502,4813,>132" and plain.alphabet == "+,0123456789:=>"


@pytest.mark.parametrize("restate", [1, 31, 109])
def test_scratch_add_restate_after_moves_the_same_filler(restate):
    """After the answer or before the worked part: the same characters, sums and worked answer, one
    ';' longer; the bound on the answer's length stays tight."""
    kw = {"max_digits": 4, "scratch_frac": 1.0, "restate": restate}
    before, after = get_task("scratch_add", **kw), get_task("scratch_add", restate_at="after", **kw)
    level0 = get_task("scratch_add", max_digits=4, scratch_frac=1.0)
    exs = after.sample(random.Random(0), 2000)
    assert exs == before.sample(random.Random(0), 2000)
    for e in exs:
        b, a, worked = before.gold_completion(e), after.gold_completion(e), level0.gold_completion(e)
        assert a == worked + ";" + b[: len(b) - len(worked)] and after.reward(e, a) == 1.0
        assert len(a) <= after.max_answer_chars and set(a) <= set(after.alphabet)
    assert max(len(after.gold_completion(e)) for e in exs) == after.max_answer_chars


@pytest.mark.parametrize("kwargs, message", [
    ({"restate": -1}, "restate must be an integer from 0 to 676, got -1"),
    ({"restate": 677}, "restate must be an integer from 0 to 676, got 677"),
    ({"restate": 1.5}, "restate must be an integer from 0 to 676, got 1.5"),
    ({"restate": 3, "verbosity": 1}, r"restate \(3\) and verbosity \(1\) both lengthen the worked answer; set one"),
    ({"restate": 3, "restate_at": "end"}, "restate_at must be one of before, after, got 'end'"),
])
def test_scratch_add_rejects_bad_restate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_task("scratch_add", **kwargs)
