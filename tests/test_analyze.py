"""``timlab analyze``: the shipped sample end to end, bad input (whole-file errors raise, bad rows are
listed and left out), Parquet and JSONL alike, the CLI's exit codes, and the TRL/verl converters."""

from __future__ import annotations

import base64
import json
import math
import random
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import timlab
from timlab.cli import main
from timlab.experiments.diagnostics.analyze import (
                                                    HARM_NEEDS_ADVANTAGES,
                                                    SCHEMA,
                                                    AnalyzeError,
                                                    analyze_file,
                                                    analyze_records,
                                                    from_trl_inputs,
                                                    from_verl_batch,
                                                    read_records,
                                                    write_rows,
                                                    )
from timlab.metrics import advantage_metrics, all_metrics
from timlab.metrics.persistence import PERSISTENCE_KEYS

SAMPLE = Path(timlab.__file__).parent / "data" / "sample_logprobs.jsonl"


def good_row(i: int, n: int = 4, *, offset: float = 0.01, step: int | None = None) -> dict:
    train = [-0.5 - 0.1 * j - 0.01 * i for j in range(n)]
    row = {"id": f"r{i}", "trainer_logprobs": train, "rollout_logprobs": [x - offset for x in train]}
    if step is not None:
        row["step"] = step
    return row


def write_jsonl(path: Path, rows: list, *, raw_tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + raw_tail)
    return path


class _Doc(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])


# ------------------------------------------------------------------------------ the sample
def test_sample_is_small_and_real():
    assert SAMPLE.is_file() and SAMPLE.stat().st_size < 100_000
    records, errors, fmt = read_records(SAMPLE)
    assert (len(records), errors, fmt) == (64, [], "jsonl")
    assert sorted({r["step"] for r in records}) == [1, 2, 3, 4]
    for r in records:
        assert len(r["tokens"]) == len(r["trainer_logprobs"]) == len(r["rollout_logprobs"]) > 0
        assert all(x <= 0 for x in r["trainer_logprobs"] + r["rollout_logprobs"])


def test_sample_analyzes_end_to_end(tmp_path):
    res = analyze_file(SAMPLE, out_html=tmp_path / "report.html")
    m = res["metrics"]
    assert all(math.isfinite(v) for v in m.values())
    assert 0 < m["mismatch/max_abs_diff"] < 1e-4  # fast engine vs trainer forward, fp32: small but real
    assert 0 < m["mismatch/frac_bitwise_equal"] < 1
    assert (res["num_rows"], res["num_valid"], res["num_invalid"], res["errors"]) == (64, 64, 0, [])
    assert [s["step"] for s in res["per_step"]] == [1, 2, 3, 4]
    assert [s["num_sequences"] for s in res["per_step"]] == [16] * 4
    assert sum(s["num_tokens"] for s in res["per_step"]) == res["num_tokens"] == m["mismatch/num_tokens"]
    assert sum(res["histogram"]["counts"]) == res["num_tokens"]
    assert sum(res["by_position"]["counts"]) == res["num_tokens"]
    assert sum(res["by_prob"]["counts"]) == res["num_tokens"]
    assert sum(res["by_length"]["counts"]) == 64
    assert res["reward_mean"] is not None
    json.dumps(res, allow_nan=False)  # JSON-ready

    text = Path(res["report"]).read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    doc = _Doc()
    doc.feed(text)
    assert len(doc.imgs) >= 6  # histogram, position, probability, 2 x length, per step
    for src in doc.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in text and "https://" not in text  # self-contained
    assert "Per step" in text and "rollout_corr/k3_kl" in text


def test_metrics_equal_all_metrics_on_the_padded_batch():
    records, _, _ = read_records(SAMPLE)
    T = max(len(r["trainer_logprobs"]) for r in records)
    pad = lambda xs: xs + [0.0] * (T - len(xs))  # noqa: E731
    train = torch.tensor([pad(r["trainer_logprobs"]) for r in records], dtype=torch.float64)
    roll = torch.tensor([pad(r["rollout_logprobs"]) for r in records], dtype=torch.float64)
    mask = torch.tensor([[1] * len(r["trainer_logprobs"]) + [0] * (T - len(r["trainer_logprobs"])) for r in records])
    res = analyze_file(SAMPLE)
    # the sample has steps and token ids, so its metrics add persistence (tests/test_analyze_persistence.py)
    without = lambda m: {k: v for k, v in m.items() if k not in PERSISTENCE_KEYS}  # noqa: E731
    assert set(res["metrics"]) - set(all_metrics(train, roll, mask)) == set(PERSISTENCE_KEYS)
    assert without(res["metrics"]) == all_metrics(train, roll, mask)
    step1 = [i for i, r in enumerate(records) if r["step"] == 1]
    assert without(res["per_step"][0]["metrics"]) == all_metrics(train[step1], roll[step1], mask[step1])


def _random_rows(seed: int, n: int, steps: int) -> list[dict]:
    """Rows of 1-40 tokens at random steps (1 to ~10 rows per step), some masked, some rewarded."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(1, 40)
        train = [-rng.expovariate(1.0) for _ in range(k)]
        row = {"step": rng.randrange(steps), "trainer_logprobs": train,
               "rollout_logprobs": [min(0.0, x + rng.gauss(0, 0.05)) if rng.random() < 0.7 else x for x in train]}
        if rng.random() < 0.5:
            row["reward"] = rng.random()
        if rng.random() < 0.3:
            row["mask"] = [1] + [int(rng.random() < 0.8) for _ in range(k - 1)]
        rows.append(row)
    return rows


def test_per_step_metrics_equal_all_metrics_of_each_step(tmp_path):
    # the per-step table is computed for every step at once (steps with equal row counts stacked);
    # each step's metrics must still be all_metrics of its own rows, bit for bit
    rows = _random_rows(3, 120, 40) + [dict(good_row(900 + i), step=1000 + i) for i in range(30)]  # + one-row steps
    res = analyze_file(write_jsonl(tmp_path / "steps.jsonl", rows))
    T = max(len(r["trainer_logprobs"]) for r in rows)  # one chunk: the file's padding
    pad = lambda xs: xs + [0.0] * (T - len(xs))  # noqa: E731
    train = torch.tensor([pad(r["trainer_logprobs"]) for r in rows], dtype=torch.float64)
    roll = torch.tensor([pad(r["rollout_logprobs"]) for r in rows], dtype=torch.float64)
    mask = torch.tensor([pad([float(x) for x in r.get("mask", [1] * len(r["trainer_logprobs"]))]) for r in rows])
    steps = sorted({r["step"] for r in rows})
    assert [s["step"] for s in res["per_step"]] == steps
    assert len({s["num_sequences"] for s in res["per_step"]}) >= 4  # several stacked batches
    for s in res["per_step"]:
        idx = [i for i, r in enumerate(rows) if r["step"] == s["step"]]
        assert s["metrics"] == all_metrics(train[idx], roll[idx], mask[idx]), s["step"]
        assert s["num_sequences"] == len(idx) and s["num_tokens"] == int(mask[idx].sum())
        rewards = [rows[i]["reward"] for i in idx if "reward" in rows[i]]
        assert s["reward_mean"] == (sum(rewards) / len(rewards) if rewards else None)


def test_absurd_magnitudes_are_refused_and_means_stay_finite(tmp_path):
    # issue #22: finite log-probs near -1e308 made analyze's means overflow to inf
    absurd = [{"trainer_logprobs": [-0.1, -1e308], "rollout_logprobs": [-0.2, -0.3]} for _ in range(4)]
    _raises(write_jsonl(tmp_path / "absurd.jsonl", absurd), "no valid rows", "column trainer_logprobs",
            "trainer_logprobs[1] = -1e+308 is below -1e+100")
    good = [good_row(i, 6) for i in range(8)]
    mixed = analyze_file(write_jsonl(tmp_path / "mixed.jsonl", good + absurd[:1] + [dict(good_row(9), reward=1e300)]))
    assert [(e["row"], e["column"]) for e in mixed["errors"]] == [(8, "trainer_logprobs"), (9, "reward")]
    assert mixed["metrics"] == analyze_file(write_jsonl(tmp_path / "good.jsonl", good))["metrics"]
    # at the limit every number is finite and correct: |r| = 1e100 everywhere, rewards of 1e100
    big = [{"step": i % 3, "trainer_logprobs": [-1e100] * 50, "rollout_logprobs": [-0.5] * 50, "reward": 1e100}
           for i in range(300)]
    res = analyze_file(write_jsonl(tmp_path / "big.jsonl", big))
    floats = []

    def walk(x):
        if isinstance(x, dict):
            [walk(v) for v in x.values()]
        elif isinstance(x, list):
            [walk(v) for v in x]
        elif isinstance(x, float):
            floats.append(x)

    walk(res)
    assert floats and not any(math.isinf(x) for x in floats)
    for m in [res["metrics"]] + [s["metrics"] for s in res["per_step"]]:
        assert m["mismatch/abs_diff_mean"] == pytest.approx(1e100, rel=1e-12)
        assert m["rollout_corr/training_log_ppl"] == pytest.approx(1e100, rel=1e-12)
        assert m["rollout_corr/training_ppl"] == pytest.approx(math.exp(600), rel=1e-12)  # the documented clamp
    assert res["reward_mean"] == pytest.approx(1e100, rel=1e-12)
    ls = res["length_scaling"]
    assert ls["rms_sum"] == pytest.approx([t * (1e100 - 0.5) for t in ls["lengths"]], rel=1e-9)  # r^2 summed: finite


def test_perplexity_mean_over_many_sequences_stays_finite():
    # exp(700) ~ 1e304 per sequence overflowed the sum over 20k sequences; the clamp at 600 leaves room
    lp = torch.full((20_000, 1), -1e4, dtype=torch.float64)
    m = all_metrics(lp, torch.full_like(lp, -0.5), torch.ones_like(lp))
    assert m["rollout_corr/training_ppl"] == pytest.approx(math.exp(600), rel=1e-12)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(600), rel=1e-12)
    assert all(math.isfinite(v) for v in m.values())


def _same_up_to_rounding(a, b, path=""):
    """Equal structure, exact ints/strings, floats equal to the last bits (sums regrouped by chunk)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same_up_to_rounding(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_up_to_rounding(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-14), path
    else:
        assert a == b, path


def _mixed_file(tmp_path: Path) -> Path:
    """Rows without a step, then rows with one, and bad rows on both sides of the first step."""
    rng = random.Random(0)
    rows = [good_row(i, rng.randint(1, 30), offset=rng.uniform(0, 0.02)) for i in range(6)]
    rows[2]["reward"] = "x"  # invalid either way; with steps it also lacks one
    rows[3]["rollout_logprobs"] = rows[3]["rollout_logprobs"][:-1]  # ragged: checked before the step
    rows += [good_row(10 + i, rng.randint(1, 30), step=i // 3) for i in range(9)] + [good_row(20)]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


@pytest.mark.parametrize("name", ["sample", "mixed", "truncated"])
def test_streamed_chunks_give_the_one_batch_result(tmp_path, monkeypatch, name):
    # the default chunk holds these files whole; 32-cell chunks cut them into many pieces
    import timlab.experiments.diagnostics.analyze as analyze

    if name == "sample":
        path = SAMPLE
    elif name == "mixed":
        path = _mixed_file(tmp_path)
    else:
        text = SAMPLE.read_text()
        path = tmp_path / "cut.jsonl"
        path.write_text(text[: text.rindex("}", 0, len(text) - 2)])  # the last line cut off
    whole = analyze_file(path)
    assert whole == analyze_records(read_records(path)[0], read_errors=read_records(path)[1],
                                    source=str(path)) | {"format": "jsonl"}  # the in-memory path agrees
    monkeypatch.setattr(analyze, "CHUNK_CELLS", 32)
    _same_up_to_rounding(whole, analyze_file(path))
    if name == "mixed":  # rows before the first step lack one, so they are invalid, with check_row's errors
        assert whole["num_valid"] == 9 and [s["num_sequences"] for s in whole["per_step"]] == [3, 3, 3]
        assert [(e["row"], e["column"]) for e in whole["errors"]] == [
            (0, "step"), (1, "step"), (2, "step"), (2, "reward"), (3, "rollout_logprobs"), (4, "step"), (5, "step"),
            (15, "step")]


def test_parquet_and_jsonl_agree(tmp_path):
    records, _, _ = read_records(SAMPLE)
    pq_path = write_rows(records, tmp_path / "sample.parquet")
    jl_path = write_rows(records, tmp_path / "sample.jsonl")
    a, b = analyze_file(pq_path), analyze_file(jl_path)
    assert a["format"] == "parquet" and b["format"] == "jsonl"
    assert a["metrics"] == b["metrics"] == analyze_file(SAMPLE)["metrics"]
    assert a["per_step"] == b["per_step"]
    # an unknown extension is sniffed
    (tmp_path / "dump.bin").write_bytes(pq_path.read_bytes())
    assert analyze_file(tmp_path / "dump.bin")["format"] == "parquet"


# ------------------------------------------------------------------------------ bad input
def _raises(path, *fragments):
    with pytest.raises(AnalyzeError) as exc:
        analyze_file(path)
    msg = str(exc.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_whole_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        analyze_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    _raises(tmp_path / "empty.jsonl", "empty file", "trainer_logprobs")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    _raises(tmp_path / "blank.jsonl", "no rows")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"trainer_logprobs": pa.array([], pa.list_(pa.float64())),
                             "rollout_logprobs": pa.array([], pa.list_(pa.float64()))}), tmp_path / "empty.parquet")
    _raises(tmp_path / "empty.parquet", "no rows")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    _raises(tmp_path / "broken.parquet", "not a readable Parquet file")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    _raises(tmp_path / "binary.jsonl", "not UTF-8")
    rows = [{"trainer_logprobs": [-1.0], "logprobs": [-1.0]}] * 2
    msg = _raises(write_jsonl(tmp_path / "nocol.jsonl", rows), "missing column 'rollout_logprobs'", SCHEMA)
    assert "columns: logprobs, trainer_logprobs" in msg
    write_rows(rows, tmp_path / "nocol.parquet")
    _raises(tmp_path / "nocol.parquet", "missing column 'rollout_logprobs'")


BAD_ROWS = {
    # name: (row, column, fragment of the problem)
    "ragged": ({"trainer_logprobs": [-1.0] * 12, "rollout_logprobs": [-1.0] * 11}, "rollout_logprobs",
               "trainer_logprobs has 12 values, rollout_logprobs 11"),
    "nan": ({"trainer_logprobs": [-1.0, float("nan")], "rollout_logprobs": [-1.0, -1.0]}, "trainer_logprobs",
            "trainer_logprobs[1] = nan at a valid position"),
    "inf": ({"trainer_logprobs": [-1.0, -1.0], "rollout_logprobs": [float("-inf"), -1.0]}, "rollout_logprobs",
            "rollout_logprobs[0] = -inf at a valid position"),
    "null": ({"trainer_logprobs": [-1.0, None], "rollout_logprobs": [-1.0, -1.0]}, "trainer_logprobs",
             "trainer_logprobs[1] = nan"),
    "string": ({"trainer_logprobs": [-1.0, -2.0], "rollout_logprobs": [-1.0, "abc"]}, "rollout_logprobs",
               "rollout_logprobs[1] = 'abc' is not a number"),
    "scalar": ({"trainer_logprobs": -1.0, "rollout_logprobs": [-1.0]}, "trainer_logprobs",
               "must be a list of numbers, got float"),
    "missing": ({"trainer_logprobs": [-1.0]}, "rollout_logprobs", "missing column rollout_logprobs"),
    "positive": ({"trainer_logprobs": [-1.0, 0.7], "rollout_logprobs": [-1.0, -1.0]}, "trainer_logprobs",
                 "trainer_logprobs[1] = 0.7 > 0"),
    "empty": ({"trainer_logprobs": [], "rollout_logprobs": []}, "trainer_logprobs", "no response tokens"),
    "mask_value": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "mask": [2]}, "mask",
                   "mask[0] = 2; mask values must be 0 or 1"),
    "mask_length": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "mask": [1, 0]}, "mask",
                    "mask has 2 values, trainer_logprobs 1"),
    "mask_zero": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "mask": [0]}, "mask", "all 0"),
    "tokens": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "tokens": [1, 2]}, "tokens",
               "tokens has 2 values"),
    "reward": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "reward": "high"}, "reward",
               "not a finite number"),
    "advantage": ({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "advantage": float("inf")}, "advantage",
                  "advantage = inf is not a finite number"),
}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_is_listed_and_the_rest_analyzed(tmp_path, case, fmt):
    bad, column, fragment = BAD_ROWS[case]
    if fmt == "parquet" and case in ("string", "scalar", "missing", "reward"):
        pytest.skip("Parquet columns have one type; a mixed-type or absent cell cannot be written")
    good = [good_row(i) for i in range(3)]
    rows = good[:2] + [bad] + good[2:]
    path = write_rows(rows, tmp_path / f"data.{fmt}")
    res = analyze_file(path)
    assert (res["num_rows"], res["num_valid"], res["num_invalid"]) == (4, 3, 1)
    assert len(res["errors"]) == 1
    err = res["errors"][0]
    assert (err["row"], err["column"]) == (2, column)
    assert fragment in err["problem"], err["problem"]
    assert res["metrics"] == analyze_records(good)["metrics"]  # bad rows change nothing
    # a file of only this bad row cannot be analyzed: one line, naming the row and the column
    only = write_rows([bad], tmp_path / f"only.{fmt}")
    if case == "missing":  # absent from every row: a whole-file error
        _raises(only, "missing column 'rollout_logprobs'", SCHEMA)
    else:
        assert fragment in _raises(only, "no valid rows", f"row 0, column {column}")


def test_nan_at_a_masked_position_is_fine(tmp_path):
    rows = [{"trainer_logprobs": [-1.0, float("nan")], "rollout_logprobs": [-1.1, None], "mask": [1, 0]}]
    res = analyze_file(write_jsonl(tmp_path / "m.jsonl", rows))
    assert res["num_valid"] == 1 and res["num_tokens"] == 1
    assert res["metrics"]["mismatch/max_abs_diff"] == pytest.approx(0.1)


def test_truncated_and_invalid_jsonl_lines(tmp_path):
    good = [good_row(i) for i in range(3)]
    path = write_jsonl(tmp_path / "cut.jsonl", good, raw_tail='{"trainer_logprobs": [-1.0, -2')
    res = analyze_file(path)
    assert (res["num_valid"], res["num_invalid"]) == (3, 1)
    assert res["errors"][0]["row"] == 3 and "line 4: truncated JSON on the last line" in res["errors"][0]["problem"]
    path = write_jsonl(tmp_path / "mid.jsonl", good[:1], raw_tail="{oops\n[1, 2]\n\n" + json.dumps(good[1]) + "\n")
    res = analyze_file(path)
    assert res["num_valid"] == 2
    assert [(e["row"], e["problem"].split(":")[0]) for e in res["errors"]] == [(1, "line 2"), (2, "line 3")]
    assert "invalid JSON" in res["errors"][0]["problem"] and "expected a JSON object" in res["errors"][1]["problem"]
    _raises(write_jsonl(tmp_path / "allcut.jsonl", [], raw_tail='{"trainer_logp'), "no valid rows", "truncated JSON")


def test_step_column(tmp_path):
    rows = [good_row(0, step=1), good_row(1, step=2), good_row(2, step=2), good_row(3), good_row(4, step=1.5)]
    res = analyze_file(write_jsonl(tmp_path / "s.jsonl", rows))
    assert [(s["step"], s["num_sequences"]) for s in res["per_step"]] == [(1, 1), (2, 2)]
    assert [(e["row"], e["column"]) for e in res["errors"]] == [(3, "step"), (4, "step")]
    assert analyze_file(write_jsonl(tmp_path / "n.jsonl", rows[3:4]))["per_step"] == []


# ------------------------------------------------------------------------------ CLI
def test_cli_exit_codes(tmp_path, capsys):
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["analyze", str(SAMPLE), "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert "64 of 64 rows valid" in printed and "max |r|" in printed and f"report: {out}" in printed
    assert json.loads(js.read_text())["metrics"] == analyze_file(SAMPLE)["metrics"]
    assert out.read_text().startswith("<!DOCTYPE html>")

    partial = write_jsonl(tmp_path / "p.jsonl", [good_row(0), BAD_ROWS["ragged"][0]])
    assert main(["analyze", str(partial)]) == 1  # analyzed, with a bad row left out
    assert "row 1, column rollout_logprobs: ragged" in capsys.readouterr().out

    for argv, fragment in (
        ([str(tmp_path / "missing.jsonl")], "no such file"),
        ([str(write_jsonl(tmp_path / "nocol.jsonl", [{"trainer_logprobs": [-1.0]}]))], "missing column"),
        ([str(write_jsonl(tmp_path / "bad.jsonl", [BAD_ROWS["nan"][0]]))], "row 0, column trainer_logprobs"),
    ):
        assert main(["analyze", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("timlab: error:") and fragment in err and "\n" not in err


def test_59_24_a_folder_without_alarm_says_what_a_run_folder_needs(tmp_path, capsys):
    """Issue 59, finding 24: ``timlab analyze RUN_DIR`` without --alarm said "RUN_DIR: no such file"
    for a folder that exists."""
    run = tmp_path / "run"
    run.mkdir()
    assert main(["analyze", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"timlab: error: {run} is a folder, not a Parquet or JSONL file of per-sequence log-probs; a run "
                   "folder is read with --alarm RULE (`timlab analyze RUN_DIR --alarm grad_norm_change`: its "
                   "metrics.parquet)")


# ------------------------------------------------------------------------------ converters
def _verl_batch(B: int = 4, P: int = 3, T: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 2, 4, 1][:B]
    response_mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    response_mask[0, 3] = 0  # a multi-turn tool token inside the response
    old = -torch.rand(B, T, generator=g) * 3  # (B, T) fp32, like verl
    rollout = old - 0.01 * torch.randn(B, T, generator=g)
    old[response_mask == 0] = 0.0
    rollout[response_mask == 0] = 0.0
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])[:B]  # left-padded
    prompts = torch.randint(4, 10, (B, P), generator=g) * prompt_mask
    responses = torch.randint(4, 10, (B, T), generator=g) * response_mask
    scores = torch.zeros(B, T)
    scores[torch.arange(B), torch.tensor(lengths) - 1] = torch.tensor([1.0, 0.0, 0.5, 0.25])[:B]
    tensors = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": response_mask,
               "prompts": prompts, "responses": responses, "token_level_scores": scores,
               "attention_mask": torch.cat([prompt_mask, response_mask], 1)}
    return tensors, lengths


class _CharTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 4) for i in ids if i >= 4)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_verl_converter_round_trip(tmp_path, ext):
    tensors, lengths = _verl_batch()
    # a DataProto-like object: verl's DataProto has .batch, .non_tensor_batch, .meta_info
    proto = SimpleNamespace(batch=tensors, non_tensor_batch={"uid": ["a", "a", "b", "b"]},
                            meta_info={"global_steps": 7})
    rows = from_verl_batch(proto, tokenizer=_CharTok())
    assert [len(r["trainer_logprobs"]) for r in rows] == lengths
    assert rows[0]["mask"] == [1, 1, 1, 0, 1, 1]
    assert [r["step"] for r in rows] == [7] * 4 and [r["uid"] for r in rows] == ["a", "a", "b", "b"]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.5, 0.25]
    assert rows[2]["prompt"] == _CharTok().decode(tensors["prompts"][2, 2:].tolist())
    assert rows[1]["response"] == _CharTok().decode(rows[1]["tokens"]) and len(rows[1]["tokens"]) == 2
    res = analyze_file(write_rows(rows, tmp_path / f"verl.{ext}"))
    want = all_metrics(tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"])
    assert res["metrics"] == want  # exact: fp32 values survive the file as doubles
    assert res["per_step"][0]["step"] == 7 and res["reward_mean"] == pytest.approx(1.75 / 4)
    # a plain dict with attention_mask only (no response_mask) gives the same rows' numbers
    plain = {k: v for k, v in tensors.items() if k != "response_mask"}
    rows2 = from_verl_batch(plain, step=7)
    assert [r["trainer_logprobs"] for r in rows2] == [r["trainer_logprobs"] for r in rows]
    assert [r["mask"] for r in rows2] == [r["mask"] for r in rows]
    with pytest.raises(ValueError, match="rollout_log_probs.*calculate_log_probs=True"):
        from_verl_batch({"old_log_probs": tensors["old_log_probs"]})


def test_trl_converter_round_trip(tmp_path):
    tensors, lengths = _verl_batch()
    samp = tensors["rollout_log_probs"].clone()
    samp[2, 1] = float("nan")  # vLLM could not score this token: TRL stores NaN
    inputs = {"prompt_ids": tensors["prompts"], "prompt_mask": tensors["attention_mask"][:, :3],
              "completion_ids": tensors["responses"], "completion_mask": tensors["response_mask"],
              "old_per_token_logps": tensors["old_log_probs"], "sampling_per_token_logps": samp,
              "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0])}
    rows = from_trl_inputs(inputs, step=3, tokenizer=_CharTok())
    assert rows[2]["rollout_logprobs"][1] is None and rows[2]["mask"] == [1, 0, 1, 1]
    assert [r["advantage"] for r in rows] == [0.5, -0.5, 1.0, -1.0]
    res = analyze_file(write_rows(rows, tmp_path / "trl.jsonl"))
    mask = tensors["response_mask"].clone()
    mask[2, 1] = 0
    assert res["metrics"] == all_metrics(tensors["old_log_probs"], samp, mask)
    # without old_per_token_logps TRL's trainer side must be passed in
    del inputs["old_per_token_logps"]
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        from_trl_inputs(inputs)
    assert from_trl_inputs(inputs, trainer_logps=tensors["old_log_probs"], step=3, tokenizer=_CharTok()) == rows
    with pytest.raises(ValueError, match="rollout_func"):
        from_trl_inputs({"old_per_token_logps": tensors["old_log_probs"]})


# ------------------------------------------------------------------------------ harm statistics
def test_sample_without_advantages_says_the_harm_statistics_need_them(tmp_path, capsys):
    res = analyze_file(SAMPLE)
    assert res["harm"] is None and "advantage" not in res["columns"]
    assert main(["analyze", str(SAMPLE)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("harm:"))
    assert HARM_NEEDS_ADVANTAGES in line and "need an 'advantage' column" in line
    assert f"TV mean {res['metrics']['mismatch/tv_mean']:.3g}" in line


def test_advantage_column_gives_the_advantage_weighted_statistics(tmp_path, capsys):
    tensors, _ = _verl_batch()
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])
    inputs = {"completion_ids": tensors["responses"], "completion_mask": tensors["response_mask"],
              "old_per_token_logps": tensors["old_log_probs"], "sampling_per_token_logps": tensors["rollout_log_probs"],
              "advantages": adv}
    rows = from_trl_inputs(inputs, step=1)
    rows.append(good_row(9, step=1))  # a row without an advantage: in the metrics, not in the harm statistics
    path = write_rows(rows, tmp_path / "adv.jsonl")
    res = analyze_file(path)
    want = advantage_metrics(tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"], adv)
    assert res["harm"]["num_sequences"] == 4
    assert res["harm"]["metrics"] == pytest.approx(want, rel=1e-12)
    assert res["metrics"]["mismatch/num_tokens"] == int(tensors["response_mask"].sum()) + 4
    assert main(["analyze", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("harm:"))
    assert f"mean A*r {want['mismatch/adv_diff_mean']:.3g}" in line and "over 4 sequences" in line
    assert HARM_NEEDS_ADVANTAGES not in line


def test_verl_advantages_become_the_advantage_column_and_stream_like_one_batch(tmp_path, monkeypatch):
    import timlab.experiments.diagnostics.analyze as analyze

    tensors, _ = _verl_batch()
    mask = tensors["response_mask"]
    per_token = torch.tensor([1.0, -2.0, 0.25, 3.0])[:, None] * mask  # verl: (B, T), 0 off the mask
    rows = from_verl_batch({**tensors, "advantages": per_token}, step=2)
    assert [r["advantage"] for r in rows] == [1.0, -2.0, 0.25, 3.0]
    path = write_rows(rows * 5, tmp_path / "verl.jsonl")  # 20 rows: many chunks at 32 cells
    whole = analyze_file(path)
    rep = lambda t: torch.cat([t] * 5)  # noqa: E731
    want = advantage_metrics(rep(tensors["old_log_probs"]), rep(tensors["rollout_log_probs"]), rep(mask), rep(per_token))
    assert whole["harm"]["metrics"] == pytest.approx(want, rel=1e-12)
    monkeypatch.setattr(analyze, "CHUNK_CELLS", 32)
    _same_up_to_rounding(whole, analyze_file(path))


def test_write_rows_formats(tmp_path):
    rows = [good_row(i, step=1) for i in range(2)]
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        write_rows(rows, tmp_path / "x.csv")
    with pytest.raises(ValueError, match="append=True needs a JSONL file"):
        write_rows(rows, tmp_path / "x.parquet", append=True)
    path = tmp_path / "run.jsonl"
    write_rows(rows[:1], path, append=True)
    write_rows(rows[1:], path, append=True)
    assert analyze_file(path)["num_valid"] == 2


# ------------------------------------------------------------------------------ TRL end to end
def test_trl_grpo_hook_dumps_rows(tmp_path, monkeypatch):
    """The docs/analyze.md TRL hook on a real GRPOTrainer (CPU): a rollout_func returns HF generate's
    log-probs minus 0.05 and num_iterations=2 makes TRL compute old_per_token_logps itself."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from timlab.model.hf_io import save_model
    from timlab.model.llama import CausalLM, ModelConfig
    from timlab.tasks import get_task
    from timlab.tokenizer import save_char_tokenizer

    task = get_task("reverse", min_len=2, max_len=4)
    save_char_tokenizer(task.alphabet, tmp_path / "tok")
    cfg = ModelConfig(vocab_size=4 + len(task.alphabet), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    save_model(CausalLM(cfg), tmp_path / "model", tokenizer_dir=tmp_path / "tok")
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "model")
    prompts = [e.prompt for e in task.sample(random.Random(0), 16)]
    dump = tmp_path / "logprobs.jsonl"

    def rollout_func(prompts, trainer):
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        P = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id] * (P - len(i)) + i for i in ids])  # (B, P) left-padded
        am = (torch.arange(P)[None] >= torch.tensor([P - len(i) for i in ids])[:, None]).long()
        model = trainer.model
        was = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=am, do_sample=True, top_k=0, max_new_tokens=5,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        model.train(was)
        seq = out.sequences[:, P:]  # (B, C)
        lp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, seq[..., None])[..., 0]  # (B, C)
        comp, logps = [], []
        for s, l in zip(seq.tolist(), lp.tolist()):
            n = s.index(tok.eos_token_id) + 1 if tok.eos_token_id in s else len(s)
            comp.append(s[:n])
            logps.append([v - 0.05 for v in l[:n]])
        return {"prompt_ids": ids, "completion_ids": comp, "logprobs": logps}

    class DumpingGRPOTrainer(GRPOTrainer):  # the hook of docs/analyze.md
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            write_rows(from_trl_inputs(out, step=self.state.global_step, tokenizer=self.processing_class),
                       dump, append=True)
            return out

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=5, num_iterations=2, max_steps=2, learning_rate=1e-3, report_to=[],
                      save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0, logging_steps=1)
    trainer = DumpingGRPOTrainer(model=str(tmp_path / "model"), processing_class=tok, args=args,
                                 reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                 train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func)
    trainer.train()
    res = analyze_file(dump)
    assert res["num_invalid"] == 0 and res["num_valid"] >= 4
    # r = log pi (TRL's teacher-forced forward) - (HF generate's log-prob - 0.05)
    assert res["metrics"]["mismatch/diff_mean"] == pytest.approx(0.05, abs=1e-4)
    assert res["metrics"]["mismatch/max_abs_diff"] == pytest.approx(0.05, abs=1e-4)
