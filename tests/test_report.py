"""The HTML report: self-contained (every image a valid embedded PNG), the expected sections,
runs with missing metrics listed by name, sweep and run-directory inputs, and a real headless
Chromium render when Chromium is installed."""

import base64
import io
import json
import math
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from timlab import cli
from timlab.config import resolve
from timlab.experiments.reports.report import GRAD_PLOTS, PLOTS, build_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECTIONS = ["Collapse rule", "Conditions", "Dose-response", "Training curves", "Runs", "Runs with missing metrics"]


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.links, self.scripts = [], [], 0
        self.headings: dict[str, list[str]] = {"h1": [], "h2": [], "h3": []}
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if tag in ("link", "a") and ("href" in a):
            self.links.append(a["href"])
        if tag == "script":
            self.scripts += 1
        if tag in self.headings:
            self._in = tag
            self.headings[tag].append("")

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in:
            self.headings[self._in][-1] += data


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def png_size(uri: str) -> tuple[int, int]:
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix), uri[:40]
    data = base64.b64decode(uri[len(prefix):], validate=True)
    assert data[:8] == PNG_SIGNATURE
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        return im.size


def fake_run(d: Path, *, magnitude: float, seed: int, collapse: bool, drop=(), metrics=True, steps=20,
             gradcheck: bool = False):
    """A run directory with a hand-made metrics table (length-decay columns included)."""
    d.mkdir(parents=True)
    cfg = resolve(preset="smoke", overrides={"mismatch": {"injector": "head_perturb" if magnitude else "none",
                                                          "magnitude": magnitude},
                                             "run": {"seed": seed, "steps": steps}})
    (d / "config.yaml").write_text(cfg.to_yaml())
    state = "finished"
    if metrics:
        rng = np.random.default_rng(seed)
        rows = []
        for s in range(steps + 1):
            acc = (0.2 + 0.03 * s) if not collapse or s < 10 else 0.02
            row = {"step": s, "val/accuracy": acc if s % 2 == 0 else math.nan}
            if s:
                row.update({
                    "train/reward_mean": 0.3 + 0.01 * s + 0.02 * rng.standard_normal(),
                    "rollout_corr/log_ppl_abs_diff": magnitude * 0.3, "rollout_corr/k3_kl": magnitude * 0.2,
                    "train/grad_norm_ema": 1 + 0.1 * s, "train/grad_norm": 1 + 0.1 * s, "train/loss": 0.1,
                    "train/response_length_mean": 5.0 if s < 6 else 15.0,
                    "train/lr": 3e-4 * 2.0 ** -(s // 11),
                    "scheduler/surge_step": 6.0 if s >= 6 else math.nan,
                    "scheduler/decay_period": 11.0 if s >= 6 else math.nan,
                })
            if gradcheck and s and s % 2 == 0:
                row.update({"gradcheck/rel_bias": 0.1 * magnitude * (1 + 0.1 * s), "gradcheck/cosine_plugin": 0.9,
                            "gradcheck/snr_exact": 0.01, "gradcheck/snr_tim": 0.01 / (1 + s)})
            rows.append({k: v for k, v in row.items() if k not in drop})
        pd.DataFrame(rows).to_parquet(d / "metrics.parquet", index=False)
    else:
        state = "failed"
    (d / "status.json").write_text(json.dumps({"state": state, "step": steps if metrics else 0,
                                               "total_steps": steps, "message": "" if metrics else "boom"}))
    return d


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    return [
        fake_run(d / "ctl_s0", magnitude=0.0, seed=0, collapse=False),
        fake_run(d / "ctl_s1", magnitude=0.0, seed=1, collapse=False),
        fake_run(d / "head_s0", magnitude=2.0, seed=0, collapse=True),
        fake_run(d / "head_s1", magnitude=2.0, seed=1, collapse=True, drop=("rollout_corr/k3_kl", "train/grad_norm_ema")),
        fake_run(d / "head_s2", magnitude=2.0, seed=2, collapse=False, metrics=False),
    ]


def check_page(path: Path) -> Page:
    page = parse(path)
    assert page.headings["h1"] == ["timlab report"]
    for s in SECTIONS:
        assert s in page.headings["h2"], s
    for metric, _, _ in PLOTS:
        assert any(metric in h for h in page.headings["h3"]), metric
    assert page.imgs, "no images"
    for uri in page.imgs:
        w, h = png_size(uri)
        assert w > 100 and h > 100
    assert page.scripts == 0 and not page.links  # nothing external, nothing to fetch
    assert "http://" not in path.read_text() and "https://" not in path.read_text()
    return page


def test_report_of_run_dirs(runs, tmp_path):
    res = build_report(runs, tmp_path / "r" / "report.html")
    assert res.path.exists() and res.n_runs == 5
    assert dict(res.missing) == {"head_s1": ["rollout_corr/k3_kl", "train/grad_norm_ema"],
                                 "head_s2": [m for m, _, _ in PLOTS]}
    page = check_page(res.path)
    assert len(page.imgs) == 1 + len(PLOTS)  # dose-response + one per metric
    text = res.path.read_text()
    missing_section = text.split("Runs with missing metrics</h2>")[1]
    assert "<b>head_s1</b>" in missing_section and "rollout_corr/k3_kl" in missing_section
    assert "<b>head_s2</b> [failed] (no metrics.parquet)" in missing_section
    # grouped by the config keys that differ (seed excluded)
    assert "mismatch.injector=none, mismatch.magnitude=0.0" in text
    assert "mismatch.injector=head_perturb, mismatch.magnitude=2.0" in text
    assert "2/2" in text  # head: both complete runs collapsed
    assert ">collapsed (peak rule)</th>" in text
    assert "steps to collapse (peak rule)" in text  # the runs table names the rule too (issue 60)
    assert "falls below 0.5 x its running peak" in text
    noted = build_report(runs, tmp_path / "n.html", note="Computed with torch 9 <x>").path.read_text()
    assert '<p class="note">Computed with torch 9 &lt;x&gt;</p>' in noted and "Computed with" not in text


def test_report_shows_gradient_diagnostics_when_runs_logged_them(tmp_path):
    d = tmp_path / "g"
    dirs = [fake_run(d / "ctl", magnitude=0.0, seed=0, collapse=False, gradcheck=True),
            fake_run(d / "head", magnitude=2.0, seed=0, collapse=True, gradcheck=True)]
    res = build_report(dirs, tmp_path / "g.html")
    page = check_page(res.path)
    assert "Gradient diagnostics" in page.headings["h2"]
    for metric, _, _ in GRAD_PLOTS:
        assert any(metric in h for h in page.headings["h3"]), metric
    assert "Before a collapse" in page.headings["h3"]  # the collapsed run, aligned on its collapse step
    assert len(page.imgs) == 1 + len(PLOTS) + len(GRAD_PLOTS) + 1
    assert res.missing == []  # gradcheck metrics are optional: nobody is reported for lacking them


def test_report_of_a_sweep_dir_and_cli(runs, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rows = []
    for r in runs:
        shutil.copytree(r, sweep / r.name)
        rows.append({"run_id": r.name, "run_dir": r.name, "condition": "control" if "ctl" in r.name else "head_2"})
    pd.DataFrame(rows).to_parquet(sweep / "index.parquet", index=False)
    out = tmp_path / "sweep_report.html"
    assert cli.main(["report", str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 runs" in printed and "head_s1" in printed and "head_s2" in printed
    check_page(out)
    assert ">control<" in out.read_text() and ">head_2<" in out.read_text()
    assert cli.main(["report", str(sweep), str(runs[0]), "--out", str(out)]) == 2
    assert "pass it alone" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "nope"), "--out", str(out)]) == 2


def test_report_of_a_real_run(tmp_path):
    from timlab.trainer.run import train

    cfg = resolve(preset="smoke", overrides={"run": {"steps": 2}})
    train(cfg, tmp_path / "real")
    res = build_report([tmp_path / "real"], tmp_path / "real.html")
    assert res.n_runs == 1 and res.missing == []
    check_page(res.path)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(runs, tmp_path):
    from PIL import Image

    res = build_report(runs, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,3000",
           res.path.resolve().as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    assert shot.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(shot) as im:
        assert im.size == (1200, 3000)
        gray = np.asarray(im.convert("L"), dtype=float)
    assert gray.std() > 10  # not a blank page
    assert (gray < 128).mean() > 0.005  # text and plot lines were drawn
    colors = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    assert len(np.unique(colors[::97], axis=0)) > 50  # the embedded plots rendered (not only text)


def test_report_reads_like_the_terminal(runs, tmp_path):
    """Issue 60: run names broke mid-word, claims were cited by number only, means read
    `0.5 ± 0.075` where the terminal prints `0.500 +- 0.075`, and markers at one point hid each other."""
    import re

    from timlab.experiments.reports.report import _dose_points

    text = build_report(runs, tmp_path / "r.html").path.read_text()
    runs_table = text[text.index("<h2>Runs</h2>"):]
    assert '<td class="l">head_<wbr>s0</td>' in runs_table and '<td class="l">ctl_<wbr>s1</td>' in runs_table
    prose = re.sub(r'src="data:[^"]*"', "", text)
    cited = re.findall(r"\bP\d\b", prose)
    assert cited and re.findall(r"\bP\d\b(?! \()", prose) == []  # every claim says what it claims
    assert "P2 (the larger the mismatch, the sooner and the more often runs collapse)" in prose
    assert "\u00b1" not in prose and re.search(r"<td class=\"\">0\.\d{3} \+- 0\.\d{3}</td>", prose)
    table = pd.DataFrame({"group": ["a", "b", "c"], "k3_kl_mean": [0.0, 0.0, 0.4],
                          "collapse_frac": [0.0, 0.0, 0.5], "median_steps_to_collapse": [math.nan, math.nan, 30.0]})
    assert _dose_points(table, "collapse_frac") == [("a", 0.0, 0.0, 150.0), ("b", 0.0, 0.0, 90.0), ("c", 0.4, 0.5, 150.0)]
    assert _dose_points(table, "median_steps_to_collapse") == [("c", 0.4, 30.0, 150.0)]
