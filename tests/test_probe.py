"""The ``timlab probe`` command end to end: zero mismatch for exact vs trainer, a real one for fast,
op-level attribution, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from timlab.cli import main
from timlab.model.hf_io import save_model
from timlab.model.llama import CausalLM, ModelConfig, random_init_
from timlab.tokenizer import save_char_tokenizer

CHARS = "0123456789+-= abcdef"
VOCAB = 4 + len(CHARS)  # <pad> <bos> <eos> <unk>, then one id per character
REPO = Path(__file__).resolve().parents[1]


def _model(vocab_size: int = VOCAB, context: int = 64) -> CausalLM:
    cfg = ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    g = torch.Generator().manual_seed(0)
    model = CausalLM(cfg)
    random_init_(model, g)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    save_char_tokenizer(CHARS, path)
    save_model(_model(), path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("12+34=\nabc\n\n9-3=\n a b \n7\n")  # the blank line is skipped
    return path


def probe(tmp_path, folder, prompts, *args) -> dict:
    out = tmp_path / "probe.json"
    argv = ["probe", "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "16",
            "--samples-per-prompt", "3", "--json", str(out), *args]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_vs_trainer_is_bitwise_zero(tmp_path, folder, prompts, capsys, dtype):
    res = probe(tmp_path, folder, prompts, "--rollout", "exact", "--score", "trainer", "--dtype", dtype)
    assert res["max_abs_diff"] == 0.0 and res["mean_abs_diff"] == 0.0
    assert res["frac_bitwise_equal"] == 1.0 and res["k3_kl"] == 0.0
    assert res["num_sequences"] == 15 and res["num_prompts"] == 5
    assert res["num_tokens"] > 0 and res["tokens_per_s"] > 0
    assert (res["rollout"], res["score"], res["dtype"], res["seed"]) == ("exact", "trainer", dtype, 0)
    assert 0 < res["mean_response_length"] <= 16
    assert sum(res["abs_diff_by_position"]["counts"]) == res["num_tokens"]
    assert sum(res["abs_diff_by_prob"]["counts"]) == res["num_tokens"]
    assert "max |r| 0" in capsys.readouterr().out


def test_fast_vs_trainer_is_a_small_real_mismatch(tmp_path, folder, prompts):
    res = probe(tmp_path, folder, prompts, "--rollout", "fast", "--score", "trainer")
    assert 0 < res["max_abs_diff"] < 1e-4
    assert res["frac_bitwise_equal"] < 1.0
    assert res["k3_kl"] >= 0


def test_same_seed_same_rollout(tmp_path, folder, prompts):
    a = probe(tmp_path, folder, prompts, "--rollout", "fast", "--seed", "3")
    b = probe(tmp_path, folder, prompts, "--rollout", "fast", "--seed", "3")
    for key in ("num_tokens", "max_abs_diff", "mean_abs_diff", "k3_kl", "mean_response_length"):
        assert a[key] == b[key]


def test_hf_rollout_and_score(tmp_path, folder, prompts):
    pytest.importorskip("transformers")
    res = probe(tmp_path, folder, prompts, "--rollout", "hf", "--score", "trainer")
    assert res["num_tokens"] > 0 and res["max_abs_diff"] < 1e-4
    res = probe(tmp_path, folder, prompts, "--rollout", "exact", "--score", "hf")
    assert res["max_abs_diff"] < 1e-4


def test_num_prompts_takes_the_files_first_prompts(tmp_path, folder, prompts, capsys):
    res = probe(tmp_path, folder, prompts, "--num-prompts", "2")
    assert res["num_prompts"] == 2 and res["num_sequences"] == 6
    argv = ["probe", "--model", str(folder), "--prompts", str(prompts), "--num-prompts", "6"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "num_prompts=6 but prompts file" in err and "has 5 prompts" in err


def test_task_prompts(tmp_path, folder):
    out = tmp_path / "task.json"
    argv = ["probe", "--model", str(folder), "--task", "addition", "--num-prompts", "4",
            "--max-new-tokens", "8", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["num_sequences"] == 4 and res["max_abs_diff"] == 0.0


# ------------------------------------------------------------------------------ attribution
def _expected_ops(num_layers: int = 2) -> list[str]:
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{op}" for op in ("attn_norm", "attn_out", "mlp_norm", "mlp_out", "output")]
    return names + ["final_norm", "logits"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attribution_exact_vs_trainer_all_equal(tmp_path, folder, prompts, dtype):
    res = probe(tmp_path, folder, prompts, "--rollout", "exact", "--score", "trainer", "--dtype", dtype, "--attribute")
    assert [op["name"] for op in res["ops"]] == _expected_ops()
    assert res["first_divergent_op"] is None
    assert res["replay_bitwise_equal"] is True
    assert all(op["bitwise_equal"] and op["max_abs_diff"] == 0.0 for op in res["ops"])


def test_attribution_fast_vs_trainer_finds_the_first_divergent_op(tmp_path, folder, prompts, capsys):
    res = probe(tmp_path, folder, prompts, "--rollout", "fast", "--score", "trainer", "--attribute")
    names = [op["name"] for op in res["ops"]]
    assert names == _expected_ops()
    first = res["first_divergent_op"]
    assert first is not None
    k = names.index(first)
    assert all(op["bitwise_equal"] for op in res["ops"][:k])
    assert res["ops"][k]["max_abs_diff"] > 0 and res["ops"][k]["rel_diff"] > 0
    # embedding and the first norm are lookups/row-wise: equal; the first matmul-based op is not
    assert first == "layers.0.attn_out"
    assert res["ops"][-1]["name"] == "logits" and not res["ops"][-1]["bitwise_equal"]
    assert res["replay_bitwise_equal"] is True  # the replay reproduces the fast engine's own log-probs
    assert "first divergent op: layers.0.attn_out" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_hooks_do_not_change_the_numbers(mode):
    """Attribution runs the hooked forward; it must compute the same bits as the plain one."""
    from timlab.model.forward import full_step

    model = _model()
    tokens = torch.randint(4, VOCAB, (5, 32), generator=torch.Generator().manual_seed(0))
    key_valid = torch.ones_like(tokens, dtype=torch.bool)
    key_valid[1, :7] = False
    seen = []
    with torch.no_grad():
        plain = model(tokens, full_step(key_valid), mode=mode)
        model.hooks.append(lambda name, t: seen.append(name))
        hooked = model(tokens, full_step(key_valid), mode=mode)
    assert torch.equal(plain, hooked)
    assert seen == _expected_ops()


# ------------------------------------------------------------------------------ bad input
def _error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory, folder) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    big_tok = root / "big_tokenizer"  # a tokenizer with more ids than the model's vocab
    save_char_tokenizer(CHARS + "ghijklmnopqrstuvwxyz", big_tok)
    save_model(_model(), big_tok)
    no_weights = root / "no_weights"
    save_char_tokenizer(CHARS, no_weights)
    (no_weights / "config.json").write_text((folder / "config.json").read_text())
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return {"big_tokenizer": big_tok, "no_weights": no_weights, "gpt2": gpt2, "empty": root / "empty"}


@pytest.mark.parametrize(
    "case,expected",
    [
        ("unknown_engine", "unknown engine 'nope'; valid choices: exact, fast, hf, vllm"),
        ("trainer_rollout", "'trainer' is not a rollout engine"),
        ("unknown_score", "unknown score path 'nope'; valid choices: trainer, exact, fast, hf"),
        ("missing_prompts", "does not exist"),
        ("empty_prompts", "is empty"),
        ("long_prompt", "more than the model's context (max_position_embeddings=64)"),
        ("big_tokenizer", "tokenizer has 44 tokens but the model's vocab_size is 24"),
        ("no_config", "no config.json"),
        ("no_weights", "no model.safetensors"),
        ("gpt2", "unsupported architecture model_type='gpt2'"),
        ("attribute_hf", "attribution needs op hooks"),
        ("bad_top_p", "top_p must be in (0, 1]"),
        ("unknown_task", "unknown task 'nope'; valid choices:"),
        ("huge_seed", "seed must be an integer in [0, 4294967295], got 100000000000000000000000"),
    ],
)
def test_bad_input_gives_one_line_error(tmp_path, folder, prompts, bad_folders, capsys, case, expected):
    model, prompt_file, extra = str(folder), str(prompts), []
    if case == "unknown_engine":
        extra = ["--rollout", "nope"]
    elif case == "trainer_rollout":
        extra = ["--rollout", "trainer"]
    elif case == "unknown_score":
        extra = ["--score", "nope"]
    elif case == "missing_prompts":
        prompt_file = str(tmp_path / "missing.txt")
    elif case == "empty_prompts":
        (tmp_path / "empty.txt").write_text("\n\n")
        prompt_file = str(tmp_path / "empty.txt")
    elif case == "long_prompt":
        (tmp_path / "long.txt").write_text("12\n" + "1" * 60 + "\n")
        prompt_file = str(tmp_path / "long.txt")
    elif case in ("big_tokenizer", "no_weights", "gpt2"):
        model = str(bad_folders[case])
    elif case == "no_config":
        model = str(bad_folders["empty"])
    elif case == "attribute_hf":
        extra = ["--rollout", "hf", "--attribute"]
    elif case == "bad_top_p":
        extra = ["--top-p", "1.5"]
    elif case == "huge_seed":
        extra = ["--seed", "100000000000000000000000"]
    argv = ["probe", "--model", model, "--max-new-tokens", "16", *extra]
    argv += ["--task", "nope"] if case == "unknown_task" else ["--prompts", prompt_file]
    line = _error(capsys, argv)
    assert line.startswith("timlab: error: ")
    assert expected in line
    if case == "long_prompt":
        assert "prompt 2 of prompts file" in line and "60 tokens" in line


def test_bad_input_through_python_m_timlab(tmp_path, folder):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "timlab", "probe", "--model", str(folder), "--prompts", str(tmp_path / "none.txt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    missing = str(tmp_path / "none.txt")
    assert proc.stderr.strip().splitlines() == [f"timlab: error: prompts file {missing!r} does not exist"]
    assert proc.stdout == ""


def test_attribution_html_page(tmp_path, folder, prompts):
    import base64
    import re

    page = tmp_path / "probe.html"
    res = probe(tmp_path, folder, prompts, "--rollout", "fast", "--score", "trainer", "--attribute", "--html", str(page))
    assert sum(res["abs_diff_by_entropy"]["counts"]) == res["num_tokens"]
    html = page.read_text()
    imgs = re.findall(r"src='data:image/png;base64,([^']+)'", html)
    assert len(imgs) == 4  # divergence by op + position, probability, entropy breakdowns
    for data in imgs:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"<b>{res['first_divergent_op']}</b>" in html
    assert html.count("<tr><td>layers.") == sum(o["name"].startswith("layers.") for o in res["ops"])
    assert "http" not in html.replace("https://", "")  # self-contained


def test_cli_options_not_given_are_not_passed_and_help_quotes_the_library_defaults(capsys):
    """Every default lives in run_probe's signature: the parser's are None, its help reads them from there."""
    import inspect

    from timlab.cli import build_parser
    from timlab.experiments.diagnostics.probe import run_probe

    args = build_parser().parse_args(["probe", "--model", "m", "--task", "addition"])
    for name in ("num_prompts", "samples_per_prompt", "rollout", "score", "dtype", "max_new_tokens", "seed",
                 "temperature", "top_p", "top_k", "device"):
        assert getattr(args, name) is None, name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["probe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = inspect.signature(run_probe).parameters
    assert f"--max-new-tokens MAX_NEW_TOKENS default {defaults['max_new_tokens'].default}" in text
    assert f"(default {defaults['rollout'].default})" in text and "{default}" not in text


# ------------------------------------------------------------------------------ injector calibration
def test_interpolate_magnitude_by_hand():
    from timlab.experiments.diagnostics.probe import interpolate_magnitude

    # total ~ magnitude^2: halfway in log total between 0.1 and 0.4 is sqrt(2) in magnitude
    assert interpolate_magnitude([1.0, 2.0], [0.1, 0.4], 0.2) == pytest.approx(2 ** 0.5, rel=1e-12)
    assert interpolate_magnitude([2.0, 1.0, 4.0], [0.4, 0.1, 1.6], 0.8) == pytest.approx(2 * 2 ** 0.5, rel=1e-12)
    assert interpolate_magnitude([1.0, 2.0], [0.1, 0.4], 0.4) == pytest.approx(2.0)
    assert interpolate_magnitude([1.0, 2.0], [0.1, 0.4], 0.5) is None  # not bracketed
    assert interpolate_magnitude([1.0, 2.0], [0.0, 0.4], 0.2) is None  # log of 0


def calibrate(tmp_path, folder, prompts, *args) -> dict:
    out = tmp_path / "cal.json"
    argv = ["probe", "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "16",
            "--samples-per-prompt", "4", "--json", str(out), "--injector", "head_perturb", *args]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_calibration_matches_arms_on_total_k3(tmp_path, folder, prompts, capsys):
    """T * k3 = mean length x per-token k3, growing with the magnitude; an arm confined to the first
    4 response tokens reaches only those (<= 4 of ~16) and needs a larger magnitude for the same
    total; the calibrated magnitude, rolled out, realizes the target within the interpolation's error."""
    every = calibrate(tmp_path, folder, prompts, "--magnitudes", "0.05,0.1,0.2,0.4", "--target-total-k3", "0.5")
    rows = every["rows"]
    assert [x["magnitude"] for x in rows] == [0.05, 0.1, 0.2, 0.4]
    for x in rows:
        assert x["total_k3"] == pytest.approx(x["k3"] * x["mean_length"], rel=1e-12)
        assert x["num_tokens"] == pytest.approx(20 * x["mean_length"])  # 5 prompts x 4 samples
    totals = [x["total_k3"] for x in rows]
    assert all(a < b for a, b in zip(totals, totals[1:])) and totals[0] < 0.5 < totals[-1]
    assert rows[-1]["frac_tokens_reached"] > 0.9
    m_every = every["calibrated_magnitude"]
    assert 0.05 < m_every < 0.4
    first4 = calibrate(tmp_path, folder, prompts, "--magnitudes", "0.1,0.2,0.4,0.8,1.6", "--mismatch", "position_max=4",
                       "--target-total-k3", "0.5")
    assert first4["mismatch"] == {"position_max": 4}
    for x in first4["rows"]:
        assert 0 < x["frac_tokens_reached"] * x["mean_length"] <= 4 + 1e-9
    assert first4["calibrated_magnitude"] > m_every
    check = calibrate(tmp_path, folder, prompts, "--magnitudes", str(m_every))
    assert check["rows"][0]["total_k3"] == pytest.approx(0.5, rel=0.35)
    out = capsys.readouterr().out
    assert "calibration: injector=head_perturb (other mismatch settings: position_max=4)" in out
    assert "target T * k3 0.5: magnitude" in out


@pytest.mark.parametrize("args, msg", [
    (["--magnitudes", "0.5", "--mismatch", "entropy_min=-1"], "mismatch.entropy_min must be a finite number"),
    (["--magnitudes", "0,1"], "magnitudes must be one or more finite numbers > 0"),
    (["--magnitudes", "a,b"], "--magnitudes takes numbers separated by commas"),
    (["--magnitudes", "0.5", "--rollout", "fast"], "--rollout is for comparing engines"),
    ([], "--injector needs --magnitudes"),
])
def test_calibration_bad_input_is_one_line(tmp_path, folder, prompts, capsys, args, msg):
    argv = ["probe", "--model", str(folder), "--prompts", str(prompts), "--injector", "head_perturb", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


def test_calibration_flags_need_an_injector(tmp_path, folder, prompts, capsys):
    assert main(["probe", "--model", str(folder), "--prompts", str(prompts), "--magnitudes", "1"]) == 2
    assert "--magnitudes calibrates an injector; give --injector too" in capsys.readouterr().err


@pytest.fixture(scope="module")
def scratch_folder(tmp_path_factory) -> Path:
    """A random model over scratch_add's characters (restated operands, ':' opening the worked answer)."""
    from timlab.tasks import get_task

    chars = get_task("scratch_add", restate=2).alphabet
    path = tmp_path_factory.mktemp("scratch_model")
    save_char_tokenizer(chars, path)
    save_model(_model(vocab_size=4 + len(chars), context=96), path)
    return path


def test_calibration_of_a_marker_scope(tmp_path, scratch_folder, capsys):
    """``--mismatch after_text=:`` (the CLI keeps ':' as text) confines head_perturb to the tokens
    after a row's first ':', ``before_text=:`` to the rest: each arm reaches part of the tokens,
    the unscoped one nearly all."""
    def arm(*scope):
        out = tmp_path / "cal.json"
        assert main(["probe", "--model", str(scratch_folder), "--task", "scratch_add", "--task-kwarg", "restate=2",
                     "--num-prompts", "8", "--samples-per-prompt", "4", "--max-new-tokens", "32", "--json", str(out),
                     "--injector", "head_perturb", "--magnitudes", "0.5", *scope]) == 0
        return json.loads(out.read_text())

    every, after, before = arm(), arm("--mismatch", "after_text=:"), arm("--mismatch", "before_text=:")
    assert after["mismatch"] == {"after_text": ":"} and before["mismatch"] == {"before_text": ":"}
    reached = [r["rows"][0]["frac_tokens_reached"] for r in (every, after, before)]
    assert reached[0] > 0.9 and 0.05 < reached[1] < 0.8 and 0.2 < reached[2] < 0.95, reached
    assert "other mismatch settings: after_text=:" in capsys.readouterr().out
    assert main(["probe", "--model", str(scratch_folder), "--task", "scratch_add", "--injector", "head_perturb",
                 "--magnitudes", "0.5", "--mismatch", "after_text=:>"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mismatch.after_text ':>' is 2 tokens of the model's tokenizer, not one" in err and "\n" not in err
