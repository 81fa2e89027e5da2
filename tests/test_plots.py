"""Plots a reader can trust at a glance: identical conditions drawn distinctly and named, legends
outside the data, a threshold plot titled in plain words, a runs table as wide as the page."""

import re
import shutil
import subprocess

import numpy as np
import pytest
from test_report import fake_run

from timlab.config import resolve
from timlab.experiments.reports import page
from timlab.experiments.reports import report
from timlab.experiments.studies.threshold import plot_threshold, threshold_study
from test_threshold import _fake_sweep


@pytest.fixture
def twin_runs(tmp_path):
    """A control and an injected condition, plus a remedy whose runs equal the injected ones
    bit for bit (a scheduler that never acted): two seeds each."""
    d = tmp_path / "runs"
    runs = []
    for seed in (0, 1):
        runs.append(fake_run(d / f"ctl_s{seed}", magnitude=0.0, seed=seed, collapse=False))
        runs.append(fake_run(d / f"head_s{seed}", magnitude=2.0, seed=seed, collapse=True))
        twin = fake_run(d / f"twin_s{seed}", magnitude=2.0, seed=seed, collapse=True)
        cfg = resolve(preset="smoke", overrides={"mismatch": {"injector": "head_perturb", "magnitude": 2.0},
                                                 "scheduler": {"name": "length_decay"},
                                                 "run": {"seed": seed, "steps": 20}})
        (twin / "config.yaml").write_text(cfg.to_yaml())
        runs.append(twin)
    return runs


def _figures(monkeypatch) -> list:
    figs = []
    real = page.png_uri

    def keep(fig):
        figs.append(fig)
        return real(fig)

    monkeypatch.setattr(page, "png_uri", keep)
    return figs


def test_identical_conditions_are_named_and_drawn_distinctly(twin_runs, tmp_path, monkeypatch):
    figs = _figures(monkeypatch)
    res = report.build_report(twin_runs, tmp_path / "r.html")
    text = res.path.read_text()
    note = re.search(r"<strong>Identical conditions:</strong> (.*?)\. Their runs", text)
    assert note is not None
    later, earlier = note.group(1).split(" = ")
    assert "length_decay" in later and "length_decay" not in earlier
    val = next(f for f in figs if f.axes[0].get_ylabel() == "val/accuracy")
    lines = {line.get_label(): line for line in val.axes[0].get_lines()}
    twin = next(label for label in lines if label.endswith(f"same curve as {earlier}"))
    first = next(label for label in lines if label.startswith(earlier + " (n="))
    assert lines[twin].get_linestyle() == "--" and lines[twin].get_marker() == "x"
    assert lines[first].get_linestyle() == "-" and lines[first].get_marker() == "o"
    np.testing.assert_array_equal(lines[twin].get_ydata(), lines[first].get_ydata())


def test_identical_conditions_need_every_curve_equal(twin_runs):
    runs, _ = report._collect(twin_runs, "condition", {"rule": report.DEFAULT_RULE})
    groups = list(dict.fromkeys(r.group for r in runs))
    assert len(report.identical_conditions(runs, groups)) == 1
    # the control's reward curve equals the injected runs' in these hand-made runs: not enough
    no_twin = [r for r in runs if "twin" not in r.name]
    assert report.identical_conditions(no_twin, list(dict.fromkeys(r.group for r in no_twin))) == {}


def _outside(fig) -> None:
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = next(a.get_legend() for a in fig.axes if a.get_legend() is not None)
    data = ax.get_window_extent()
    assert legend.get_window_extent().x0 >= data.x1, "the legend overlaps the data area"


def test_report_legends_are_outside_the_data(twin_runs, tmp_path, monkeypatch):
    figs = _figures(monkeypatch)
    report.build_report(twin_runs, tmp_path / "r.html")
    with_legend = [f for f in figs if any(a.get_legend() is not None for a in f.axes)]
    assert len(with_legend) >= 5
    for fig in with_legend:
        _outside(fig)


def test_threshold_plot_has_a_plain_title_and_an_outside_legend(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append((self, k)), real(self, *a, **k))[1])
    _fake_sweep(tmp_path / "sw")
    plot_threshold(threshold_study(tmp_path / "sw"), tmp_path / "t.png")
    (fig, kwargs), = saved
    title = fig.axes[0].get_title()
    assert title.startswith("How much mismatch makes at least 50% of the seeds collapse, by answer length")
    assert "^" not in title and kwargs["bbox_inches"] == "tight"
    _outside(fig)


def test_runs_table_fits_the_page(twin_runs, tmp_path):
    text = report.build_report(twin_runs, tmp_path / "r.html").path.read_text()
    runs_table = text[text.index("<h2>Runs</h2>"):]
    assert runs_table.split("<table", 1)[1].startswith(' class="fit"')
    assert "table.fit { table-layout: fixed; width: 100%;" in page.STYLE
    assert '<th class="">steps to collapse (peak rule)</th>' in runs_table  # headers wrap at words, name the rule


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (apt-get install -y chromium)")
def test_runs_table_fits_the_page_in_headless_chromium(twin_runs, tmp_path):
    res = report.build_report(twin_runs, tmp_path / "r.html")
    probe = tmp_path / "probe.html"
    probe.write_text(res.path.read_text().replace(
        "</body>", "<script>const t = document.querySelector('table.fit'); document.body.setAttribute("
                   "'data-fit', t.getBoundingClientRect().right <= document.body.getBoundingClientRect().right + 1 "
                   "&& document.documentElement.scrollWidth <= window.innerWidth);</script></body>"))
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,2000", "--dump-dom", probe.resolve().as_uri()]
    dom = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180).stdout
    assert 'data-fit="true"' in dom


def test_plain_math_turns_log_tick_labels_into_numbers():
    assert page.plain_math(r"$\mathdefault{10^{-2}}$") == "10⁻²"
    assert page.plain_math(r"$\mathdefault{2\times10^{1}}$") == "2×10¹"
    assert page.plain_math(r"$\mathdefault{-10^{0}}$") == "-10⁰"
    assert page.plain_math(r"$\mathdefault{0}$") == "0"
    assert page.plain_math("$a_1$ stays") == "$a_1$ stays"


def test_no_page_draws_mathdefault_on_its_log_axes(twin_runs, tmp_path, monkeypatch):
    """The report's dose-response plot (symlog x) and analyze's histogram (log y) label their
    ticks as numbers, not as the raw mathtext that png_uri's literal drawing would show."""
    from pathlib import Path

    from matplotlib.text import Text

    from timlab.experiments.diagnostics.analyze import analyze_file

    figs = _figures(monkeypatch)
    report.build_report(twin_runs, tmp_path / "r.html")
    analyze_file(Path(__file__).resolve().parents[1] / "timlab/data/sample_logprobs.jsonl", out_html=tmp_path / "a.html")
    texts = [t.get_text() for f in figs for t in f.findobj(Text) if t.get_visible()]
    assert texts and not [t for t in texts if "mathdefault" in t or "$" in t]
    logs = {a.get_scale(): a for f in figs for ax in f.axes for a in (ax.xaxis, ax.yaxis) if a.get_scale() != "linear"}
    assert set(logs) == {"log", "symlog"}
    for axis in logs.values():
        labels = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
        assert labels and all(re.fullmatch(r"-?(\d+(\.\d+)?|10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)", x) for x in labels), labels
