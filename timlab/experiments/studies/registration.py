"""A study's registration: the study file (YAML) read into frozen dataclasses, its hash, and the
freeze that keeps it from changing once its first run exists.

The file holds everything registered before the data: the sweep (a spec file, or the spec inline),
the endpoints (metric, statistic, step window, or the difference of two), the comparison families
with their correction and decision rule (per group in a grouped study: one control, validity check
and correction per group, e.g. per verbosity level), verdicts that combine several comparisons of an arm,
outcomes that combine rule verdicts and fit tests of the whole study (per scale, then across
scales), the validity checks (and runs that must repeat an earlier sweep's), descriptive tables,
fits, paragraphs with the analysis' numbers, and the FINDINGS block it writes.
docs/studies.md describes every field; each dataclass below documents its own. Paths in the file
are relative to the file's folder, except ``out`` (the sweep directory), which is relative to the
working directory, like every ``--out`` of timlab.

Freeze by hash. ``registration_hash`` is the SHA-256 of the registration (the file's mapping
without ``amendments``, ``frozen`` and ``out``, with a referenced sweep spec's own mapping in place of its
path, and the spec's ``base.config`` file's mapping in place of its path), in canonical JSON.
``timlab study run`` records it in ``<out>/study.json`` before the first run starts. From then on
the hash must stay that one, or equal the ``hash`` of the last entry of ``amendments`` (each with
its ``date`` and ``reason``, dated no earlier than the freeze): ``check_freeze`` refuses anything
else, so a registration cannot change after the data exist without saying when and why; each
amendment is recorded in ``study.json`` when first used (``record_amendments``) and may not be
edited or removed after. The files the runs read by path only (model folders, a dataset file:
``input_digests``) are recorded there by content too, and ``study run`` refuses to go on when one
changed (``check_inputs``). A sweep run before ``timlab study run`` existed has no ``study.json``;
its study file then names the hash it was registered with in ``frozen``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timlab.errors import TimlabError
from timlab.experiments.studies.endpoints import SCALED_STATS, SCALES, STATS
from timlab.files import read_text
from timlab.yaml_io import load_yaml

FREEZE_FILE = "study.json"
"""The freeze record in a study's sweep directory: the registration's hash and mapping at the first run."""
CORRECTIONS = ("holm", "none")
TESTS = ("below", "above", "within", "under")
"""A rule's test of a comparison: ``below`` / ``above`` (an effect: p and interval beyond 0), and the
two margin tests, which read the difference's interval against M = ``margin`` x the cost of the
arm ``margin_of`` (its group's control minus it, ``fits.arm_cost``): ``within`` (the interval
holds 0 and lies inside [-M, +M]: the two arms cost the same, to within M) and ``under`` (the
interval lies above -M: the arm is lower than the arm it is compared with by less than M; against
the control, its cost is under M)."""
MARGIN_TESTS = ("within", "under")
"""The tests that need ``margin`` and ``margin_of`` (no p is read, so no permutation floor applies)."""
SHOWS = ("count", "change", "pair", "t", "t_boot", "boot", "mean", "range", "scaled", "seeds", "n", "values", "nonzero")
FITS = ("power_law", "place", "length", "threshold", "predict", "growth", "signals", "length_exponent")
GROUPED_FITS = ("length", "threshold", "predict", "length_exponent")
"""Fits over the (group, arm) cells of a grouped study (``groups``); the others need an ungrouped one."""
DERIVED = {"difference": 2, "plus": 2, "log": 1}
"""Statistics of an endpoint computed from earlier endpoints of the same run (``of``), and how many
each takes: ``difference`` a - b, ``plus`` a + b, ``log`` the natural log of one (a ratio's scale: a
family on it compares geometric means)."""
SECTIONS = ("families", "tables", "fits", "verdicts")
"""The parts of the analysis after the validity line, in the default order (``order``); then
``paragraphs``, unless ``order`` places it."""
CASE_TESTS = ("below", "above", "not below", "not above")
"""What a verdict case may require of a comparison (``stats.Comparison.below`` / ``above``)."""
COMPARISON_FIELDS = ("mean", "t_ci", "boot_ci", "diff", "diff_ci", "p", "p_holm")
CELLS = ("endpoint", "comparison", "show", "show_t", "mean", "geo", "diff", "diff_fmt", "ratio", "ratio_exp", "p",
         "p_holm", "verdict")
"""The columns a family's table may list (``Family.columns``), ``verdict:RULE`` (another rule's
verdict on the same comparison), and ``diff:SPEC``, ``p:SPEC``, ``p_holm:SPEC`` (that number
alone in a Python format spec, e.g. ``diff:+.3f``)."""
FORMATTED = ("diff", "p", "p_holm")
"""The cells a family's column may print alone in a format spec of its own (``diff:+.3f``)."""
ALIGNS = ("auto", "left")
"""A table's column alignment: ``auto`` (text left, numbers right) or every column ``left``."""
"""The fields of a comparison a verdict line may print, e.g. ``{late.diff:+.4f}``, ``{late.diff_ci[0]:+.4f}``."""
RUN_FIELDS = ("min", "max", "mean", "n")
"""What a paragraph may print of an endpoint over every run: ``{runs[seconds].max:.0f}``."""
PARAGRAPH_FIELDS = re.compile(r"(?P<family>[^.\[\]]+)\[(?P<endpoint>[^\]]+)\](?:\[(?P<name>[^\]]+)\])?\.(?P<field>\w+)"
                              r"(?:\[[01]\])?")
"""A paragraph's field: ``{FAMILY[ENDPOINT][COMPARISON].FIELD}`` (a comparison's field, e.g.
``{p6[final][token_tis].p:.3f}``; COMPARISON as ``StudyResult.verdicts`` names it) or
``{runs[ENDPOINT].FIELD}`` (``RUN_FIELDS``: the endpoint over every run of the study)."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
RULE_STATES = ("holds", "fails", "opposite", "not testable")
"""What an outcome's condition may require of a family's rule verdict on one comparison: the rule
held, failed, gave its ``opposite`` text (the mirror effect; a rule without one says ``fails``), or
decided nothing (not testable under the permutation floor, a margin rule without a margin, or a
comparison not made because its group is void)."""
TEST_STATES = ("yes", "no", "undecided")
"""What an outcome's condition may require of a ``length_exponent`` fit's test: it passed, it
failed, or it decided nothing ("no decision")."""
MAX_FORMAT_WIDTH = 100
"""The largest width or precision a format spec in a study file may give (``{arm:>12}``, ``.3f``,
``diff:+.3f``): a larger one would make even a read-only ``timlab study check`` build a string that
long (``{arm:>10000000000}``: 10 GB)."""
PLACEHOLDER = re.compile(r"\{([A-Za-z][A-Za-z0-9_]*)\}")
"""A scale's placeholder in an outcome's condition, e.g. ``{endpoint}``."""
INTERVAL_TESTS = ("holds", "excludes", "below", "above")
"""What a ``length_exponent`` fit's test may require of the 95% interval [lo, hi] of the exponent b,
each against one number x: ``holds`` (lo <= x <= hi), ``excludes`` (not holds), ``below`` (hi < x),
``above`` (lo > x)."""


class StudyError(TimlabError, ValueError):
    """A bad study file, or a study that may not be run or analysed as it stands; one line."""


def refuse_markers(obj: Any, source: str, path: str = "") -> None:
    """Refuse any text (or mapping key) in a study file's mapping that holds a FINDINGS block
    marker (``text.MARKER``): written into its block, it would end the block early, and every
    ``--write`` would then duplicate the text after it. The error names the field by its path in
    the file (e.g. ``notes[0]``, ``families[1].note``)."""
    from timlab.experiments.studies.text import MARKER

    if isinstance(obj, str):
        if m := MARKER.search(obj):
            raise StudyError(f"{source}: {path or 'a key'}: holds a FINDINGS block marker ({m.group(0)!r}); study "
                             f"text may not contain <!-- findings: or <!-- /findings:")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            refuse_markers(k, source, f"{path}: key" if path else "key")
            refuse_markers(v, source, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            refuse_markers(v, source, f"{path}[{i}]")


@dataclass(frozen=True)
class Endpoint:
    """One number per run, compared between arms (``endpoints.window_stat``)."""

    name: str
    """The key families, tables and fits use (a letter, then letters, digits, _)."""
    metric: str
    """The logged metric (a metrics.parquet column, e.g. ``val/accuracy``); empty for ``difference``."""
    stat: str
    """``level``, ``slope`` (per 100 steps), ``first``, ``last``, ``start``, ``final``, ``max``,
    ``min``, ``sum``, ``fall``, or ``log_slope``, ``fall_step``, or ``difference`` / ``plus`` /
    ``log`` (of earlier endpoints, ``of``)."""
    window: tuple[int | None, int | None] = (None, None)
    """[first step, last step], both inclusive; null leaves that end open."""
    n: int = 20
    """``first`` / ``last``: how many values are averaged."""
    rule: str = "plateau"
    """``fall``: the collapse rule (``timlab.experiments.studies.collapse``: plateau or peak)."""
    label: str = ""
    """How tables name the endpoint (default: its name)."""
    of: tuple[str, ...] = ()
    """``difference``: the two earlier endpoints [a, b]; the run's value is a - b (e.g. late minus early).
    ``plus``: a + b. ``log``: one earlier endpoint, the run's value its natural log."""
    reach: float | None = None
    """The window opens at the first logged step whose value is at least this, plus ``lag`` steps
    (e.g. the slope after a run learned); the run has no value (NaN) when it never reaches it."""
    lag: int = 0
    """With ``reach``: steps after the first step that reaches it."""
    min_points: int = 2
    """``slope`` / ``log_slope``: fewer values in the window give no value (NaN)."""
    scale: str = ""
    """The scale each run's value is put on before arms are compared (``endpoints.SCALES``; e.g.
    ``logit``: the log-odds of the level, clipped to [0.005, 0.995]); empty: as measured."""


@dataclass(frozen=True)
class Rule:
    """A decision rule, as data: when a comparison counts as an effect, and what the verdict says."""

    name: str
    """The rule's name: the verdict column's header."""
    test: str = "below"
    """``below``: the difference is negative, its (Holm) p < alpha and its bootstrap interval lies
    below 0 (``stats.Comparison.below``); ``above``: the mirror image."""
    alpha: float = 0.05
    """The level the (corrected) p must stay under."""
    holds: str = "**yes**"
    """The verdict when the rule holds."""
    fails: str = "no"
    """The verdict when it does not; ``{cost}`` is replaced by what the data still allow
    (``Comparison.cost_bound``: "at most -0.0061" or "none: the interval ... lies above 0")."""
    opposite: str = ""
    """The verdict when the mirror test holds instead (e.g. "higher" for a ``below`` rule); empty:
    ``fails``."""
    requires: str = ""
    """A rule the compared-with arm's own comparison against the family's reference must hold (on
    the same endpoint) for this rule to hold, e.g. "recovers" only where the arm without the
    remedy "erodes"; empty: none."""
    unmet: str = ""
    """The verdict when the test holds but ``requires`` does not (e.g. "higher, not claimed")."""
    ratio_bound: bool = False
    """The rule holds only where, besides its test, the difference interval (of a ``log`` endpoint:
    a log ratio) lies beyond the comparison's ``bound`` on the ratio scale: exp(upper end) < bound
    for ``below``, exp(lower end) > bound for ``above``; ``{bound}`` in the texts prints it (2 decimals)."""
    interval: bool = True
    """The bootstrap interval of the difference must lie beyond 0 as well; false: the (Holm) p at
    most ``alpha`` decides alone, by the sign of the difference (a rule registered on the p only)."""
    margin: float = 0.0
    """``within`` / ``under``: M = this x the cost of ``margin_of`` (e.g. 0.5)."""
    margin_of: str = ""
    """``within`` / ``under``: the arm whose cost (its group's control minus it, on the same
    endpoint) sets the margin, e.g. the spread arm at the same length."""


@dataclass(frozen=True)
class Family:
    """Comparisons of arms against one reference arm on some endpoints; each endpoint is one
    family for the correction."""

    name: str
    """The family's name."""
    endpoints: tuple[str, ...]
    """The endpoints compared, one table each, in this order."""
    rule: str = ""
    """The decision rule applied to every comparison (a name from ``rules``); none: the tables
    have no verdict column (the comparisons are descriptive, or a ``verdicts`` entry decides)."""
    against: str = ""
    """The reference arm (default: the study's control)."""
    arms: tuple[str, ...] = ()
    """The arms compared with it (default: every other arm, in the sweep's order)."""
    correction: str = "holm"
    """``holm`` (Holm's step-down over the family's arms, per endpoint) or ``none``."""
    show: str = ""
    """An endpoint shown beside each arm as its own column (e.g. the realized k3); none if empty."""
    note: str = ""
    """Text after each table's bold title (e.g. ", arm minus control")."""
    headers: tuple[str, ...] = ()
    """The tables' header cells in place of the default ones (as many as there are columns)."""
    reference_row: bool = True
    """Each table opens with the reference arm's own row (its mean and intervals)."""
    comparisons: tuple[tuple[str, str, str], ...] = ()
    """Explicit (arm, reference, rule) comparisons in place of ``arms`` against ``against`` (e.g.
    each remedy arm against its own arm without the remedy); one Holm family per endpoint over all
    of them. An empty rule: the family's."""
    bounds: tuple[float | None, ...] = ()
    """Each explicit comparison's ``bound`` (a ratio bar for a ``ratio_bound`` rule), or None."""
    endpoint_rules: tuple[tuple[str, str], ...] = ()
    """(endpoint, rule) pairs: a rule per endpoint in place of ``rule``."""
    columns: tuple[str, ...] = ()
    """The table's columns (``CELLS``) in place of the default ones; ``headers`` then names them."""
    title: str = ""
    """One table for all endpoints under this bold title (rows endpoint by endpoint), in place of
    one table per endpoint titled by its label."""
    label: str = "{arm}"
    """A comparison's row name, a format string of ``{arm}`` and ``{against}`` (e.g. "{arm} - {against}")."""
    reference_label: str = "{against}"
    """The reference row's name (e.g. "{against} (reference)")."""
    each_reference: bool = False
    """``reference_row: each``: every reference's own row, before its first comparison (explicit
    comparisons against several references, e.g. each LR arm's control)."""
    zero: str = "0"
    """How the ``show`` column prints an exact 0 (e.g. "0.000")."""
    names: tuple[tuple[str, str], ...] = ()
    """(arm, text) pairs: how ``{arm}`` and ``{against}`` in the labels print an arm (default its
    name); a text may hold " | " to fill two columns (e.g. "stale_2 | lr 1e-4")."""
    table: bool = True
    """false: no table; the comparisons are computed for ``paragraphs`` and ``verdicts`` only."""
    heading: bool = True
    """false: no bold line above the table(s)."""
    align: str = "auto"
    """``auto``: text columns left-aligned, numbers right; ``left``: every column left."""

    def shown(self, arm: str) -> str:
        """How the family's labels print ``arm`` (``names``)."""
        return dict(self.names).get(arm, arm)

    def spans(self) -> int:
        """How many columns more than one a comparison's name fills (each " | " in it starts one)."""
        return max(t.count(" | ") for t in (self.label, self.reference_label, *(x for _, x in self.names)))

    def rule_for(self, endpoint: str, rule: str = "") -> str:
        """The rule of one comparison on ``endpoint`` (its own ``rule``, else the endpoint's, else the family's)."""
        return rule or dict(self.endpoint_rules).get(endpoint, self.rule)


@dataclass(frozen=True)
class Column:
    """One column of a descriptive table."""

    header: str
    """The column's header."""
    show: str
    """``count``: how many runs have the endpoint non-zero, with a 95% Clopper-Pearson interval;
    ``change``: the mean of the first endpoint -> the mean of the second; ``pair``: the two means
    as "a / b"; ``t``: the mean with its 95% t-interval (``digits`` decimals); ``t_boot``: the mean
    with its 95% t- and seed-bootstrap intervals; ``boot``: the mean with its bootstrap interval;
    ``mean``: the mean; ``range``: where the bootstrap interval lies (``ranges``); ``seeds``: each
    run with a value (not NaN) as "s<i>: value", i its place among the arm's runs (e.g. the step of
    each fall, a ``fall_step`` endpoint), "-" for none; ``n``: how many runs have a value;
    ``values``: each run's value (``digits`` decimals), then the mean in parentheses; ``nonzero``:
    each endpoint whose mean over the runs with a value is above 0, as "label mean" (``digits``
    decimals), joined by commas, "-" for none. ``t_boot``, ``boot``, ``mean`` and ``pair`` print as
    ``text.fmt``."""
    endpoints: tuple[str, ...]
    """The endpoint (two for ``change`` and ``pair``, one or more for ``nonzero``)."""
    digits: int = 3
    """``t``: the decimals of the mean and its interval; ``values`` and ``nonzero``: of each value."""
    format: str = ""
    """``change``: a Python format spec for both means (e.g. ``.1f``); default the tables' ``fmt``."""
    ranges: tuple[tuple[str, float | None, float | None], ...] = ()
    """``range``: (text, low, high) tried in order; the first whose [low, high] holds the arm's 95%
    bootstrap interval gives the cell (an open end: null)."""
    otherwise: str = ""
    """``range``: the cell when no range holds the interval."""
    control: str | None = None
    """The cell of the control's row in place of its value (e.g. "-"); none: its value."""
    by: str = ""
    """``scaled``: the endpoint whose control mean (the group's control in a grouped study) scales
    the mean: the cell is mean x (control mean of ``by``)^``power`` (e.g. T * k3)."""
    power: float = 1.0
    """``scaled``: the power of the control mean of ``by``."""
    ci: bool = True
    """``count``: with its 95% Clopper-Pearson interval; false: "k/n" alone."""
    partial: str = ""
    """``mean``: the mean over the runs that have a value, followed by this text when some have none
    (``{k}``: the runs with a value, ``{n}``: all); empty: the mean of every run (NaN if one has none)."""


@dataclass(frozen=True)
class Table:
    """A descriptive table, one row per arm (no test, no verdict)."""

    title: str
    """Printed in bold above the table (none if empty)."""
    columns: tuple[Column, ...]
    """The columns after the arm's name."""
    arm_header: str = "arm"
    """The header of the arms' column (e.g. "condition")."""
    note: str = ""
    """Text after the bold title (e.g. " (means over seeds [95% t])")."""
    name: str = ""
    """A name ``order`` may place the table by (default: it goes with the other tables)."""
    after: str = ""
    """A paragraph printed under the table (e.g. what T stands for)."""
    names: tuple[tuple[str, str], ...] = ()
    """(arm, text) pairs: how the rows name an arm (default its name)."""
    align: str = "auto"
    """``auto``: text columns left-aligned, numbers right; ``left``: every column left."""


@dataclass(frozen=True)
class Fit:
    """A registered fit over the arms (``timlab.experiments.studies.fits``)."""

    kind: str
    """``power_law``: excess = -c * k3^alpha over the dose arms, the other arms placed against it;
    ``place``: this study's treated arms placed against another study's power law (``study``)."""
    endpoint: str
    """The slope endpoint fitted (per 100 steps in the tables, per step in the fit)."""
    arms: str
    """The dose arms: every arm whose name starts with this."""
    k3: str = "k3"
    """The endpoint holding each run's realized k3."""
    loss: float = 0.1
    """The loss whose step count the fit predicts."""
    what: str = ""
    """How the text names that loss (e.g. "0.1 accuracy")."""
    k3_ref: float = 1e-3
    """The realized k3 the headline step count is for."""
    name: str = ""
    """How the text names the fitted endpoint (default: its label)."""
    dose_label: str = "head_perturb"
    """How the text names the dose arms."""
    study: str = ""
    """``place``: the other study's file, whose complete and valid sweep gives the law (its
    ``endpoint``, ``k3``, ``arms`` and control); this study's arms' excess is over its own control."""
    title: str = ""
    """``place``: the words that open each line (e.g. "Cross-study (rule 6, descriptive): ")."""
    endpoints: tuple[str, ...] = ()
    """``place``: every slope endpoint placed (``endpoint`` is the first), one paragraph each."""
    names: tuple[str, ...] = ()
    """``place``: how the text names each of ``endpoints`` (default: their labels)."""
    length: str = "length"
    """``length``: the endpoint whose group-control mean is the group's T (mean response length)."""
    at: tuple[int, ...] = (1000, 2000, 4000, 8000)
    """``length``: the T (tokens) the fitted loss at ``k3_ref`` is extrapolated to."""
    rho: tuple[float, ...] = (1.0, 2.0)
    """``length``: the hypotheses for rho = beta / alpha (the dose T^rho * k3); the interval decides."""
    min_cells: int = 4
    """``length``: the fit needs at least this many cells with a negative excess..."""
    min_groups: int = 2
    """``length``: ... over at least this many groups."""
    unbounded: float = 10.0
    """``length``: a fitted loss above this prints as "unbounded" (its digits carry no information)."""
    tokens: tuple[tuple[str, float], ...] = ()
    """``threshold``: (group, T) pairs: the answer length at which each group's k3*(T) is taken."""
    k3_star: float = 1e-3
    """``threshold``: the law k3*(T) = k3_star x (T / t_star)^exponent."""
    t_star: float = 465.0
    """``threshold``: see ``k3_star``."""
    exponent: float = -1.85
    """``threshold``: see ``k3_star``."""
    note: str = ""
    """``threshold``: text after the bold ``title`` (e.g. the law written out)."""
    at_T: float = 0.0
    """``predict``: the T of the predictions table written before the test's runs (0: no table)."""
    at_k3: tuple[float, ...] = ()
    """``predict``: the k3 values of that table's columns."""
    family: str = ""
    """``growth``: the family whose comparisons (a growing dose against its time-averaged constant
    dose) it decides."""
    fall: str = ""
    """``growth``: the fall endpoint whose counts decide by falls."""
    min_falls: int = 3
    """``growth``: the growing arm falls in at least this many runs and the constant arm in none;
    ``signals``: with fewer late falls they are listed one by one, no rate computed."""
    margin: float = 0.02
    """``growth``: "no" needs the difference interval of ``endpoint`` inside [-margin, +margin]."""
    unmatched: float = 2.0
    """``growth``: the two arms' mean ``k3`` further apart than this factor are flagged UNMATCHED."""
    headers: tuple[str, ...] = ()
    """``growth``: the table's header cells (6)."""
    signals: tuple[Signal, ...] = ()
    """``signals``: the signals watched before each fall."""
    reference: tuple[int, int] = (21, 60)
    """``signals``: a signal's reference is its median over these steps (inclusive)."""
    trail: int = 10
    """``signals``: a rise is judged on the trailing mean of this many steps ..."""
    rise_after: int = 60
    """``signals``: ... at the first step after this one."""
    early: int = 80
    """``signals``: falls at steps <= this leave no room for a reference and a rise (early falls)."""
    start: tuple[int, int] = (1, 5)
    """``signals``: an early fall's signals are read against their mean over these steps."""
    arm: str = ""
    """``length_exponent``: the arm whose cost (its group's control minus it) is fitted against T."""
    tests: tuple[ExponentTest, ...] = ()
    """``length_exponent``: the decision rules that read the exponent's interval."""
    max_undefined: float = 0.5
    """``length_exponent``: above this share of resamples without an exponent (a group's cost <= 0
    in the resample), no test is decided."""
    groups: tuple[str, ...] = ()
    """``length_exponent``: the groups whose cells b is fitted through (at least 2, e.g. the two
    longest lengths); empty: every valid group. A listed group that is void is left out."""


@dataclass(frozen=True)
class ExponentTest:
    """A decision rule of a ``length_exponent`` fit: it holds when the 95% interval of the exponent
    b passes every one of its conditions (``INTERVAL_TESTS``)."""

    name: str
    """How the text names it, e.g. "follows T * k3"."""
    conditions: tuple[tuple[str, float], ...]
    """(test, x) pairs, e.g. (("holds", 1.0), ("excludes", 0.0))."""
    then: str = "**yes**"
    """The verdict when every condition passes."""
    otherwise: str = "no"
    """The verdict when one does not."""


@dataclass(frozen=True)
class Signal:
    """A per-step training metric watched for a rise before a fall (a ``signals`` fit)."""

    name: str
    """How the tables name it."""
    metric: str
    """The logged metric (e.g. ``train/grad_norm``)."""
    factor: float = 1.5
    """It rises when its trailing mean exceeds this factor times its reference median."""
    over: str = ""
    """A metric it is divided by (to the ``power``), e.g. the scheduled magnitude: the signal is
    the metric against its schedule; a run where ``over`` is not positive at every step has none."""
    power: float = 1.0
    """The power of ``over``."""
    arms: str = ""
    """Only arms whose name starts with this have the signal ("n/a" elsewhere); empty: every arm."""


@dataclass(frozen=True)
class Validity:
    """The checks that void a study (nothing else is computed) when they fail."""

    control_exact: bool = True
    """Every control run keeps k3 exactly 0 and every token bitwise equal at each of its steps."""
    min_start_accuracy: float | None = None
    """The control runs' step-0 accuracy must reach this (null: no bar)."""
    same_start: bool = False
    """Every run's step-0 evaluation (accuracy and gold log-prob) is the same."""
    start_bar: float | None = None
    """``same_start``: that one step-0 accuracy must reach this; the line names the bar only when
    it does not (null: no bar)."""
    title: str = "Validity"
    """The words that open the validity line (e.g. "Validity (rule 1)")."""
    runs: str = ""
    """How ``same_start``'s part names the runs: "the same in all <runs>", "DIFFERS between <runs>"
    (default: "all N runs" and "runs"; e.g. "its runs")."""
    controls: tuple[str, ...] = ()
    """The arms ``control_exact`` and ``min_start_accuracy`` check (default: the control), e.g. each
    LR arm's own control; when given, the line counts them: "at each of the S steps of all N control
    runs"."""


@dataclass(frozen=True)
class Repeats:
    """Runs that must repeat, over their first steps, the runs of the same name in another sweep
    (a study that extends an earlier one). Reported under the validity line; a run that differs is
    named there, it does not void the study."""

    sweep: str
    """The other sweep's directory (relative to the working directory, like ``out``)."""
    last_step: int
    """Steps 0 to this are compared: every logged value but wall-clock timings, bit for bit."""


@dataclass(frozen=True)
class Case:
    """One case of a ``Verdict`` or an ``Outcome``: it applies when every one of its conditions
    passes (``first_case``)."""

    when: tuple
    """A ``Verdict``'s: (endpoint, tests) pairs, tests from ``below``, ``above``, ``not below``,
    ``not above``; an ``Outcome``'s: ``Condition``s."""
    then: str
    """The verdict's text."""


def first_case(cases: tuple[Case, ...], passes, otherwise: str) -> str:
    """The ``then`` of the first case whose conditions all pass (``passes(condition)``), else ``otherwise``."""
    return next((c.then for c in cases if all(passes(x) for x in c.when)), otherwise)


@dataclass(frozen=True)
class Condition:
    """One condition of an ``Outcome``'s case: a family's rule verdict on one comparison (``family``,
    ``endpoint``, ``group``, ``arm``) or a ``length_exponent`` fit's test (``fit``, ``test``) is in
    one of ``states``; or, with ``any``, at least one of those conditions holds."""

    family: str = ""
    """The family whose rule verdict is read."""
    endpoint: str = ""
    """The family's endpoint."""
    group: str = ""
    """The comparison's group (a grouped study; empty in an ungrouped one)."""
    arm: str = ""
    """The comparison's name: its arm, or "arm - reference" (``StudyResult.verdicts``' names)."""
    fit: str = ""
    """The ``length_exponent`` fit whose test is read (its name)."""
    test: str = ""
    """The fit's test (its name)."""
    states: tuple[str, ...] = ()
    """The condition holds when the verdict is one of these (``RULE_STATES`` of a family's rule,
    ``TEST_STATES`` of a fit's test)."""
    label: str = ""
    """How the outcome's line names what it read (default: family, endpoint, arm and group, or
    fit and test)."""
    any: tuple[Condition, ...] = ()
    """A disjunction: the condition holds when at least one of these does (then nothing else is set)."""

    def parts(self) -> tuple[Condition, ...]:
        """The plain conditions it reads: its ``any``, or itself."""
        return self.any or (self,)

    def named(self, groups: str = "group") -> str:
        """How the outcome's line names what a plain condition reads."""
        if self.label:
            return self.label
        if self.fit:
            return f"{self.fit}: {self.test}"
        return f"{self.family} {self.endpoint} {self.arm}" + (f" ({groups} {self.group})" if self.group else "")


@dataclass(frozen=True)
class Outcome:
    """A verdict over rule verdicts and fit tests from anywhere in the study (any family, group,
    arm, fit), as data: once per scale, the first case whose conditions all hold gives the scale's
    outcome (else ``otherwise``); the same outcome on every scale is the outcome, else ``mixed``.
    One line per scale names each part it read with its value, then one combined line."""

    name: str
    """The outcome's name (``StudyResult.outcomes`` keys; "Verdict NAME" opens its lines)."""
    cases: tuple[Case, ...]
    """Tried in order; their ``when`` holds ``Condition``s (with the scales' placeholders)."""
    otherwise: str
    """The outcome when no case applies."""
    scales: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(scale, ((placeholder, value), ...)) pairs: the cases are evaluated once per scale with each
    ``{placeholder}`` in a condition replaced by the scale's value; empty: once, no placeholders."""
    mixed: str = "scale-dependent: {each}"
    """The outcome when the scales disagree; ``{each}`` lists them ("X on accuracy, Y on log-odds")."""

    def resolved(self, values: tuple[tuple[str, str], ...] = ()) -> tuple[Case, ...]:
        """The cases with one scale's placeholders replaced by its values."""
        def fill(text: str) -> str:
            for k, v in values:
                text = text.replace("{" + k + "}", v)
            return text

        def sub(c: Condition) -> Condition:
            return Condition(fill(c.family), fill(c.endpoint), fill(c.group), fill(c.arm), fill(c.fit), fill(c.test),
                             c.states, fill(c.label), tuple(sub(x) for x in c.any))

        return tuple(Case(tuple(sub(c) for c in case.when), case.then) for case in self.cases)


@dataclass(frozen=True)
class Verdict:
    """A decision rule over several comparisons of one arm (e.g. a late level and a change), as
    data: the first case whose tests all pass gives the verdict; one line per arm of the family."""

    name: str
    """The verdict's name (``StudyResult.decisions`` keys)."""
    family: str
    """The family whose comparisons the cases test (a name from ``families``)."""
    cases: tuple[Case, ...]
    """Tried in order."""
    otherwise: str
    """The verdict when no case applies."""
    line: str
    """The line printed per arm, a Python format string: ``{arm}``, ``{verdict}``, and each of the
    family's endpoints with a comparison field (``{late.diff:+.4f}``, ``{late.diff_ci[0]:+.4f}``,
    ``{late.p:.4f}``; fields: mean, t_ci, boot_ci, diff, diff_ci, p, p_holm)."""
    alpha: float = 0.05
    """The level of ``below`` / ``above`` (on the Holm p of the family)."""


@dataclass(frozen=True)
class Amendment:
    """A change to the registration after its first run, recorded in the file."""

    date: str
    """When it was made (YYYY-MM-DD)."""
    reason: str
    """Why."""
    hash: str
    """The registration's hash after the change (``timlab study check`` prints it)."""


@dataclass(frozen=True)
class Block:
    """One machine block of a study whose seeds run on more than one kind of machine (``blocks``):
    the seeds it holds, the machine that runs them and the sweep directory they live in. A seed
    runs whole in one block (every arm of it, from the start that block's machine makes), so a
    difference between arms is never a difference between machines; the permutation tests then
    relabel runs within each block only (``stats.permutation_test``'s ``strata``)."""

    name: str
    """How lines name it (e.g. "amd")."""
    isa: str
    """The machine label ``machine.bits()`` gives on the machines that run it (e.g. ``avx2``,
    ``avx2-intel``): ``timlab study run`` runs the block whose label is the machine's."""
    seeds: tuple[int, ...]
    """The seeds it holds (a condition's seed: its trailing ``_s<seed>``)."""
    out: str = ""
    """Its sweep directory, relative to the working directory (default: the study's ``out``)."""
    fingerprint: str = ""
    """``machine.fingerprint()`` of its machines, when registered: ``study run`` refuses another."""


@dataclass(frozen=True)
class PredictedBy:
    """The out-of-sample sweep of a predictor study (``predicted_by``): which predictor study
    predicts its cells, each treated arm's kind, and the probe whose steps the predictions use."""

    study: str
    """The predictor study file (``kind: predictor``), relative to the working directory."""
    kinds: dict
    """Arm -> kind of mismatch, for every treated arm (the out-of-sample cells)."""
    probe: str
    """The probe's sweep directory (relative to the working directory): the probe run of a cell is
    the condition of its seed-0 run without ``_s<seed>`` (``v0_noise_0.3_s0`` -> ``v0_noise_0.3``)."""


@dataclass(frozen=True)
class Study:
    """A whole registration (see the module docstring)."""

    name: str
    """The study's name."""
    sweep: dict
    """The sweep spec's mapping (inline, or read from the file ``sweep`` names)."""
    sweep_root: str
    """The folder the spec's own relative paths (``base.config``) start from."""
    sweep_source: str
    """Where the spec came from (for messages)."""
    steps: int
    """Steps every run must reach (a run counts once it finished there, or diverged)."""
    endpoints: tuple[Endpoint, ...]
    """Per-run endpoints."""
    families: tuple[Family, ...]
    """Comparison families."""
    rules: tuple[Rule, ...]
    """Decision rules, by name."""
    control: str = "control"
    """The zero-mismatch arm."""
    groups: str = ""
    """How the text names a group (e.g. "level"): the sweep's conditions fall into groups (the
    group ``group`` of ``arm_pattern``), each with its own control, validity check (a void group
    is left out, the rest analysed) and correction families; empty: one group."""
    out: str = ""
    """The sweep directory (relative to the working directory); ``--out`` overrides it."""
    validity: Validity = Validity()
    """The validity checks."""
    tables: tuple[Table, ...] = ()
    """Descriptive tables, after the families."""
    fits: tuple[Fit, ...] = ()
    """Fits, after the tables."""
    findings: tuple[str, str] | None = None
    """(FINDINGS file, block name) the analysis writes with ``--write``."""
    blank_end: bool = False
    """The block ends with an empty line (how some blocks were first written)."""
    arm_pattern: str = ""
    """A regular expression each sweep condition must match in full; its group ``arm`` names the
    arm (default: the condition without a trailing ``_s<seed>``)."""
    repeats: Repeats | None = None
    """Runs that must repeat another sweep's runs of the same name over their first steps."""
    verdicts: tuple[Verdict, ...] = ()
    """Decision rules over several comparisons of an arm, one line per arm."""
    outcomes: tuple[Outcome, ...] = ()
    """Verdicts over rule verdicts and fit tests of the whole study, per scale and combined
    (printed in the ``verdicts`` part, after the ``verdicts``)."""
    order: tuple[str, ...] = SECTIONS
    """The order of the parts after the validity line (the default order by default)."""
    frozen: str = ""
    """The registration's hash at its first run, for a sweep started without ``timlab study run``."""
    amendments: tuple[Amendment, ...] = ()
    """Changes after the first run, oldest first."""
    notes: tuple[str, ...] = ()
    """Paragraphs printed at the end of the block (e.g. where a secondary endpoint lives)."""
    paragraphs: tuple[str, ...] = ()
    """Paragraphs with numbers of the analysis, Python format strings (``PARAGRAPH_FIELDS``),
    placed by ``order`` (default: last)."""
    source: str = "<dict>"
    """The study file (for messages)."""
    hash: str = ""
    """The registration's hash (``registration_hash``)."""
    registration: dict = field(default_factory=dict, compare=False)
    """The hashed mapping."""
    predicted_by: PredictedBy | None = None
    """The predictor study whose out-of-sample cells this sweep runs; ``timlab study run`` refuses to
    start a run before that study's ``oos`` block holds the predictions."""
    blocks: tuple[Block, ...] = ()
    """Machine blocks (``Block``): each seed's runs in one block's sweep directory; empty: every run
    in ``out``."""
    clip_bounded: bool = False
    """Not registered: clip the t-intervals of bounded endpoints (an accuracy level: [0, 1];
    ``bounds``). ``timlab study analyze`` sets it for the terminal only: the FINDINGS blocks
    (``--write``, ``--markdown``) keep the unclipped intervals they were published with."""

    def endpoint(self, name: str) -> Endpoint:
        return {e.name: e for e in self.endpoints}[name]

    def label(self, name: str) -> str:
        e = self.endpoint(name)
        return e.label or e.name

    def bounds(self, name: str) -> tuple[float, float] | None:
        """The range an endpoint's t-intervals are clipped to (an accuracy level: [0, 1]), or None
        (always, unless ``clip_bounded``)."""
        from timlab.experiments.studies.endpoints import endpoint_bounds

        e = self.endpoint(name)
        return endpoint_bounds(e.metric, e.stat, e.scale) if self.clip_bounded else None


STUDY_KEYS = ("study", "sweep", "out", "steps", "control", "arm_pattern", "groups", "validity", "repeats", "endpoints",
              "families", "rules", "verdicts", "outcomes", "tables", "fits", "order", "paragraphs", "notes", "findings",
              "frozen", "amendments", "predicted_by", "blocks")
UNHASHED = ("frozen", "amendments", "out")
"""Left out of the hash: the freeze itself, and where the runs live (``--out`` may move them)."""


def bounded_spec(spec: str, where: str) -> str:
    """A format spec a study file gives, checked before anything is formatted with it: no nested
    field, and no width or precision above ``MAX_FORMAT_WIDTH``."""
    if "{" in spec or "}" in spec:
        raise StudyError(f"{where}: format spec {spec!r}: a nested {{field}} is not allowed")
    for n in re.findall(r"\d+", spec):
        if len(n) > 6 or int(n) > MAX_FORMAT_WIDTH:
            raise StudyError(f"{where}: format spec {spec!r}: width or precision {n[:12]}"
                             f"{'...' if len(n) > 12 else ''} is above the limit of {MAX_FORMAT_WIDTH}")
    return spec


def bounded_fields(text: str, where: str) -> str:
    """A format string a study file gives (a label, a verdict's line, a paragraph), each of its
    fields' specs checked by ``bounded_spec`` before it is ever formatted."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise StudyError(f"{where}: not a format string ({e})") from None
    for _, f, spec, _ in parsed:
        if f is not None and spec:
            bounded_spec(spec, where)
    return text


def _keys(d: Any, allowed: tuple, required: tuple, where: str) -> dict:
    if not isinstance(d, dict):
        raise StudyError(f"{where}: expected a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            raise StudyError(f"{where}: unknown key {k!r}; valid choices: {', '.join(allowed)}")
    for k in required:
        if k not in d:
            raise StudyError(f"{where}: missing key {k!r}")
    return d


def _unique(names: list, where: str, what: str = "named") -> None:
    """Refuse a name given twice (a later entry would silently replace the first)."""
    twice = [n for n in names if names.count(n) > 1]
    if twice:
        raise StudyError(f"{where}: two {what} {twice[0]!r}; each needs its own name")


def _choice(v: Any, choices: tuple, where: str) -> str:
    if v not in choices:
        raise StudyError(f"{where}: {v!r}; valid choices: {', '.join(choices)}")
    return v


def _names(v: Any, known: list[str], where: str) -> tuple[str, ...]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v:
        raise StudyError(f"{where}: expected a name or a non-empty list of names")
    for x in v:
        _choice(x, tuple(known), where)
    return tuple(v)


def _int_at_least(v: Any, low: int, what: str) -> int:
    """``v``, an integer (not a bool) >= ``low``; else a one-line StudyError naming ``what``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise StudyError(f"{what} must be an integer >= {low}, got {v!r}")
    return v


def _number(v: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise StudyError(f"{where}: expected a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _window(v: Any, where: str) -> tuple[int | None, int | None]:
    if v is None:
        return (None, None)
    if not (isinstance(v, list) and len(v) == 2 and all(x is None or (isinstance(x, int) and not isinstance(x, bool)
                                                                     and x >= 0) for x in v)):
        raise StudyError(f"{where}: expected [first step, last step] (integers >= 0, or null), got {v!r}")
    if None not in v and v[0] > v[1]:
        raise StudyError(f"{where}: first step {v[0]} after last step {v[1]}")
    return (v[0], v[1])


def _endpoint(d: Any, where: str, earlier: list[str]) -> Endpoint:
    d = _keys(d, ("name", "metric", "stat", "window", "n", "rule", "label", "of", "reach", "lag", "min_points",
                  "scale"), ("name", "stat"), where)
    if not isinstance(d["name"], str) or not NAME.fullmatch(d["name"]):
        raise StudyError(f"{where}: name must be a letter followed by letters, digits or _ (got {d['name']!r})")
    n = _int_at_least(d.get("n", 20), 1, f"{where}: n")
    for key, low in (("lag", 0), ("min_points", 2)):
        _int_at_least(d.get(key, low), low, f"{where}: {key}")
    stat = _choice(d["stat"], STATS + tuple(DERIVED), f"{where}: stat")
    of: tuple[str, ...] = ()
    if stat in DERIVED:
        of = _names(d.get("of"), earlier, f"{where}: of (endpoints listed before it)")
        if len(of) != DERIVED[stat]:
            raise StudyError(f"{where}: of: {stat} takes " + (f"two endpoints [a, b] (a {'-' if stat == 'difference' else '+'} b)"
                             if DERIVED[stat] == 2 else "one endpoint") + f", got {list(of)}")
    elif "metric" not in d:
        raise StudyError(f"{where}: missing key 'metric'")
    reach = None if d.get("reach") is None else _number(d["reach"], f"{where}: reach", positive=False)
    scale = _choice(d["scale"], tuple(SCALES), f"{where}: scale") if "scale" in d else ""
    if scale and stat not in SCALED_STATS:
        raise StudyError(f"{where}: scale: {scale} applies to a level of the metric ({', '.join(SCALED_STATS)}), "
                         f"not to stat {stat}")
    return Endpoint(d["name"], str(d.get("metric", "")), stat, _window(d.get("window"), f"{where}: window"), n,
                    _choice(d.get("rule", "plateau"), ("plateau", "peak"), f"{where}: rule"), str(d.get("label", "")),
                    of, reach, d.get("lag", 0), d.get("min_points", 2), scale)


def _verdict(d: Any, where: str, families: list[Family]) -> Verdict:
    d = _keys(d, ("name", "family", "cases", "otherwise", "line", "alpha"), ("name", "family", "cases", "otherwise", "line"),
              where)
    fam = {f.name: f for f in families}[_choice(d["family"], tuple(f.name for f in families), f"{where}: family")]
    cases = []
    for i, c in enumerate(d["cases"] if isinstance(d["cases"], list) and d["cases"] else [None]):
        cw = f"{where}: cases[{i}]"
        c = _keys(c, ("when", "then"), ("when", "then"), cw)
        if not isinstance(c["when"], dict) or not c["when"]:
            raise StudyError(f"{cw}: when: expected a mapping of endpoint: test (or a list of tests)")
        when = tuple((_choice(e, fam.endpoints, f"{cw}: when: endpoint of family {fam.name}"),
                      tuple(_choice(t, CASE_TESTS, f"{cw}: when: {e}") for t in (v if isinstance(v, list) else [v])))
                     for e, v in c["when"].items())
        cases.append(Case(when, str(c["then"])))
    line = bounded_fields(str(d["line"]), f"{where}: line")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(line) if f is not None]
    except ValueError as e:
        raise StudyError(f"{where}: line: not a format string ({e})") from None
    for f in fields:
        m = re.fullmatch(r"(\w+)(?:\.(\w+)(?:\[[01]\])?)?", f)
        ok = m is not None and (m.group(1) in ("arm", "verdict") and not m.group(2)
                                or m.group(1) in fam.endpoints and m.group(2) in COMPARISON_FIELDS)
        if not ok:
            raise StudyError(f"{where}: line: field {{{f}}}; valid choices: {{arm}}, {{verdict}}, or an endpoint of "
                             f"family {fam.name} ({', '.join(fam.endpoints)}) with a field: {', '.join(COMPARISON_FIELDS)}")
    probe = dict.fromkeys(COMPARISON_FIELDS, 0.0) | {"t_ci": (0.0, 0.0), "boot_ci": (0.0, 0.0), "diff_ci": (0.0, 0.0)}
    try:  # a bad format spec ({acc.p:.4z}) is refused here, not after the data are read
        line.format(arm="a", verdict="v", **{e: type("Comparison", (), probe)() for e in fam.endpoints})
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise StudyError(f"{where}: line: {e}") from None
    alpha = _number(d.get("alpha", 0.05), f"{where}: alpha")
    return Verdict(str(d["name"]), fam.name, tuple(cases), str(d["otherwise"]), line, alpha)


def _condition(c: Any, where: str, *, inner: bool = False) -> Condition:
    """One condition of an outcome's case as written (placeholders left in; ``_check_outcome``
    checks what it names)."""
    if isinstance(c, dict) and "any" in c and not inner:
        c = _keys(c, ("any",), ("any",), where)
        if not isinstance(c["any"], list) or len(c["any"]) < 2:
            raise StudyError(f"{where}: any: expected a list of at least 2 conditions, got {c['any']!r}")
        return Condition(any=tuple(_condition(x, f"{where}: any[{i}]", inner=True) for i, x in enumerate(c["any"])))
    fit = isinstance(c, dict) and "fit" in c
    keys = ("fit", "test", "is", "label") if fit else ("family", "endpoint", "group", "arm", "is", "label")
    c = _keys(c, keys, keys[:2] + ("is",) if fit else ("family", "endpoint", "arm", "is"), where)
    states = c["is"] if isinstance(c["is"], list) and c["is"] else [c["is"]]
    if fit:  # YAML reads a bare yes / no as a boolean
        states = ["yes" if x is True else "no" if x is False else x for x in states]
    choices = TEST_STATES if fit else RULE_STATES
    states = tuple(_choice(x, choices, f"{where}: is") for x in states)
    text = {k: c[k] for k in keys if k in c and k != "is"}
    for k, v in text.items():
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise StudyError(f"{where}: {k}: expected a name, got {v!r}")
    return Condition(**{k: str(v) for k, v in text.items()}, states=states)


def _outcome(d: Any, where: str, families: list[Family], fits: list[Fit], grouped: bool) -> Outcome:
    """An outcome (``Outcome``), checked: every reference of every case, on every scale, names a
    family with a rule on that endpoint or a ``length_exponent`` fit and one of its tests (the
    groups and arms are checked against the sweep by ``engine.planned_runs``)."""
    d = _keys(d, ("name", "scales", "cases", "otherwise", "mixed"), ("name", "cases", "otherwise"), where)
    raw = d.get("scales") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) and v and all(
            isinstance(k, str) and NAME.fullmatch(k) and isinstance(x, str) for k, x in v.items())
            for v in raw.values()):
        raise StudyError(f"{where}: scales: expected a mapping of scale: {{placeholder: text}} (e.g. accuracy: "
                         f"{{endpoint: acc_level}}), got {raw!r}")
    scales = [(str(scale), tuple(values.items())) for scale, values in raw.items()]
    if len({tuple(k for k, _ in v) for _, v in scales}) > 1:
        raise StudyError(f"{where}: scales: every scale must give the same placeholders, got "
                         + "; ".join(f"{s}: {', '.join(k for k, _ in v)}" for s, v in scales))
    if not isinstance(d["cases"], list) or not d["cases"]:
        raise StudyError(f"{where}: cases: expected a non-empty list of {{when, then}}")
    cases = []
    for i, c in enumerate(d["cases"]):
        cw = f"{where}: cases[{i}]"
        c = _keys(c, ("when", "then"), ("when", "then"), cw)
        if not isinstance(c["when"], list) or not c["when"]:
            raise StudyError(f"{cw}: when: expected a non-empty list of conditions")
        cases.append(Case(tuple(_condition(x, f"{cw}: when[{j}]") for j, x in enumerate(c["when"])), str(c["then"])))
    out = Outcome(str(d["name"]), tuple(cases), str(d["otherwise"]), tuple(scales),
                  str(d.get("mixed", "scale-dependent: {each}")))
    fams = {f.name: f for f in families}
    tests = {f.name: [t.name for t in f.tests] for f in fits if f.kind == "length_exponent"}
    given = [k for k, _ in scales[0][1]] if scales else []
    for scale, values in scales or [("", ())]:
        sw = f"{where}" + (f" (scale {scale})" if scale else "")
        for i, case in enumerate(out.resolved(values)):
            for j, cond in enumerate(case.when):
                for k, c in enumerate(cond.parts()):
                    cw = f"{sw}: cases[{i}]: when[{j}]" + (f": any[{k}]" if cond.any else "")
                    for text in (c.family, c.endpoint, c.group, c.arm, c.fit, c.test, c.label):
                        for m in PLACEHOLDER.finditer(text):
                            raise StudyError(f"{cw}: {{{m.group(1)}}} is not a placeholder of the scales; "
                                             + (f"valid choices: {', '.join('{' + x + '}' for x in given)}" if given
                                                else "give scales: to use placeholders"))
                    if c.fit:
                        _choice(c.fit, tuple(tests), f"{cw}: fit (a length_exponent fit's name)")
                        _choice(c.test, tuple(tests[c.fit]), f"{cw}: test of fit {c.fit}")
                        continue
                    fam = fams[_choice(c.family, tuple(fams), f"{cw}: family")]
                    _choice(c.endpoint, fam.endpoints, f"{cw}: endpoint of family {fam.name}")
                    if not any(fam.rule_for(c.endpoint, r) for r in [x[2] for x in fam.comparisons] or [""]):
                        raise StudyError(f"{cw}: family {fam.name} decides no rule on {c.endpoint} (descriptive); an "
                                         f"outcome reads rule verdicts")
                    if bool(c.group) != grouped:
                        raise StudyError(f"{cw}: group: " + ("needed in a grouped study (the comparison's group)"
                                                             if grouped else "only a grouped study has groups"))
    return out


def _family(f: Any, where: str, names: list[str], rule_names: tuple, control: str, rules: dict) -> Family:
    f = _keys(f, ("name", "endpoints", "rule", "against", "arms", "correction", "show", "note", "headers",
                  "reference_row", "comparisons", "columns", "title", "label", "reference_label", "zero", "names",
                  "table", "heading", "align"), ("name", "endpoints"), where)
    if f["name"] == "runs":
        raise StudyError(f"{where}: name: runs is taken (paragraphs read {{runs[ENDPOINT].max}} as every run's values)")
    if "arms" in f and not (isinstance(f["arms"], list) and f["arms"] and all(isinstance(a, str) for a in f["arms"])):
        raise StudyError(f"{where}: arms: expected a non-empty list of arm names, got {f['arms']!r}")
    eps = _names(f["endpoints"], names, f"{where}: endpoints")
    rule, by_endpoint = f.get("rule") or "", ()
    if isinstance(rule, dict):  # a rule per endpoint
        by_endpoint = tuple((_choice(e, eps, f"{where}: rule: endpoint"), _choice(r, rule_names, f"{where}: rule: {e}"))
                            for e, r in rule.items())
        rule = ""
    elif rule:
        rule = _choice(rule, rule_names, f"{where}: rule")
    against = str(f.get("against", control))
    for a in f.get("arms") or []:
        if f["arms"].count(a) > 1:
            raise StudyError(f"{where}: arms: {a!r} listed twice (it would count twice in the Holm family)")
        if a == against:
            raise StudyError(f"{where}: arms: {a!r} is the reference (against: {against}); an arm is not compared "
                             f"with itself")
    comparisons, bounds = [], []
    for j, c in enumerate(f.get("comparisons") or []):
        cw = f"{where}: comparisons[{j}]"
        c = _keys(c, ("arm", "against", "rule", "bound"), ("arm",), cw)
        r = _choice(c["rule"], rule_names, f"{cw}: rule") if c.get("rule") else ""
        pair = (str(c["arm"]), str(c.get("against", against)))
        if pair[0] == pair[1]:
            raise StudyError(f"{cw}: arm {pair[0]!r} against itself; an arm is not compared with itself")
        if any(pair == (a, b) for a, b, _ in comparisons):
            raise StudyError(f"{cw}: {pair[0]} against {pair[1]} is already compared (it would count twice in the "
                             f"Holm family)")
        comparisons.append((*pair, r))
        bounds.append(_number(c["bound"], f"{cw}: bound") if "bound" in c else None)
    for j, (a, b, r) in enumerate(comparisons):
        for key in eps:
            need = rules[r or dict(by_endpoint).get(key, rule)].requires if (r or dict(by_endpoint).get(key, rule)) else ""
            if need and not any(x == b and y == against for x, y, _ in comparisons[:j]):
                raise StudyError(f"{where}: comparisons[{j}]: its rule requires {need!r} of {b} against {against}, "
                                 f"so that comparison must come before it")
    columns = tuple(c if isinstance(c, str) and c.startswith("verdict:") and _choice(c[8:], rule_names, f"{where}: "
                    f"columns: {c}") else _spec(c, f"{where}: columns") if isinstance(c, str) and ":" in c
                    else _choice(c, CELLS, f"{where}: columns") for c in f.get("columns") or ())
    bounded = {x for x in (*(c[8:] for c in columns if c.startswith("verdict:")), rule, *dict(by_endpoint).values(),
                           *(r for *_, r in comparisons)) if x and rules[x].ratio_bound}
    if bounded and not (comparisons and all(b is not None for b in bounds)):
        raise StudyError(f"{where}: rule {sorted(bounded)[0]} has ratio_bound: give each comparison a bound")
    each = f.get("reference_row", True) == "each"
    if not (each or isinstance(f.get("reference_row", True), bool)):
        raise StudyError(f"{where}: reference_row: {f['reference_row']!r}; valid choices: true, false, each")
    shown = f.get("names") or {}
    if not isinstance(shown, dict):
        raise StudyError(f"{where}: names: expected a mapping of arm: text")
    fam = Family(str(f["name"]), eps, rule, against, tuple(f["arms"]) if isinstance(f.get("arms"), list) else (),
                 _choice(f.get("correction", "holm"), CORRECTIONS, f"{where}: correction"),
                 _names(f["show"], names, f"{where}: show")[0] if f.get("show") else "", str(f.get("note", "")),
                 tuple(str(h) for h in f.get("headers") or ()), each or bool(f.get("reference_row", True)),
                 tuple(comparisons), tuple(bounds), by_endpoint, columns, str(f.get("title", "")),
                 str(f.get("label", "{arm}")), str(f.get("reference_label", "{against}")), each,
                 str(f.get("zero", "0")), tuple((str(a), str(t)) for a, t in shown.items()), bool(f.get("table", True)),
                 bool(f.get("heading", True)), _choice(f.get("align", "auto"), ALIGNS, f"{where}: align"))
    for key, text in (("label", fam.label), ("reference_label", fam.reference_label)):
        bounded_fields(text, f"{where}: {key}")
        try:
            text.format(arm="a", against="b")
        except (KeyError, IndexError, ValueError) as e:
            raise StudyError(f"{where}: {key}: {text!r} is not a format string of {{arm}} and {{against}} ({e})") from None
    if columns and not fam.headers:
        raise StudyError(f"{where}: columns: name each with headers (as many)")
    n_cols = (len(columns) or 5 + bool(fam.show) + bool(fam.rule or by_endpoint or any(r for *_, r in comparisons))) \
        + fam.spans() * ("comparison" in (columns or ("comparison",)))
    if fam.headers and len(fam.headers) != n_cols:
        raise StudyError(f"{where}: headers: {len(fam.headers)} given, the table has {n_cols} columns")
    return fam


def _spec(c: str, where: str) -> str:
    """A ``CELL:SPEC`` column (``FORMATTED``), checked: the cell and its Python format spec."""
    cell, spec = c.split(":", 1)
    _choice(cell, FORMATTED, f"{where}: {c}")
    bounded_spec(spec, f"{where}: {c}")
    try:
        format(1.0, spec)
    except ValueError:
        raise StudyError(f"{where}: {c}: {spec!r} is not a Python format spec for a number (e.g. +.3f)") from None
    return c


def _paragraph(text: Any, where: str, families: list[Family], names: list[str], grouped: bool) -> str:
    """A paragraph with numbers (``PARAGRAPH_FIELDS``), checked: each field names a family and one
    of its endpoints (the comparison is checked once the arms are known), or ``runs`` and any
    endpoint; a comparison field or a run field; its format spec fits a number."""
    if grouped:
        raise StudyError(f"{where}: not available in a grouped study; use the families' tables")
    if not isinstance(text, str):
        raise StudyError(f"{where}: expected text (a Python format string)")
    fams = {f.name: f for f in families}
    try:
        fields = [(f, spec) for _, f, spec, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise StudyError(f"{where}: not a format string ({e})") from None
    for f, spec in fields:
        m = PARAGRAPH_FIELDS.fullmatch(f)
        fam = fams.get(m.group("family")) if m else None
        ok = m is not None and (
            m.group("family") == "runs" and m.group("name") is None and m.group("endpoint") in names
            and m.group("field") in RUN_FIELDS
            or fam is not None and m.group("name") is not None and m.group("endpoint") in fam.endpoints
            and m.group("field") in COMPARISON_FIELDS)
        if not ok:
            raise StudyError(f"{where}: field {{{f}}}; valid: {{FAMILY[ENDPOINT][COMPARISON].FIELD}} (families: "
                             f"{', '.join(fams)}; fields: {', '.join(COMPARISON_FIELDS)}) or {{runs[ENDPOINT].FIELD}} "
                             f"(fields: {', '.join(RUN_FIELDS)})")
        bounded_spec(spec or "", f"{where}: field {{{f}}}")
        try:
            format(1 if m.group("field") == "n" else 1.0, spec or "")
        except ValueError:
            raise StudyError(f"{where}: field {{{f}:{spec}}}: {spec!r} is not a format spec for a number") from None
    return text


def _ranges(v: Any, where: str) -> tuple[tuple[str, float | None, float | None], ...]:
    if not isinstance(v, list) or not v:
        raise StudyError(f"{where}: expected a list of {{then, low, high}} (show range)")
    out = []
    for i, r in enumerate(v):
        r = _keys(r, ("then", "low", "high"), ("then",), f"{where}[{i}]")
        lo, hi = (None if r.get(k) is None else _number(r[k], f"{where}[{i}]: {k}", positive=False) for k in ("low", "high"))
        if lo is None and hi is None:
            raise StudyError(f"{where}[{i}]: give low, high or both")
        out.append((str(r["then"]), lo, hi))
    return tuple(out)


def _order(v: Any, families: list[Family], tables: list[Table], fits: list[Fit], verdicts: tuple, w: str,
           outcomes: tuple = ()) -> tuple[str, ...]:
    """The parts after the validity line: each kind of ``SECTIONS`` once (it places the items of
    its kind not named elsewhere), any family or named table by its name, and the fits of a kind by
    the kind (e.g. ``growth``). A fit or verdict comes after the families it reads; outcomes
    (printed with the verdicts) come after the fits whose tests they read."""
    order = tuple(v or SECTIONS)
    order += ("paragraphs",) * ("paragraphs" not in order)
    items = [f.name for f in families] + [t.name for t in tables if t.name] + [f.kind for f in fits] + ["paragraphs"]
    kinds = [x for x in order if x in SECTIONS]
    if sorted(kinds) != sorted(SECTIONS) or len(set(order)) != len(order):
        raise StudyError(f"{w}: order: expected each of {', '.join(SECTIONS)} once (and any family or named table "
                         f"once), got {list(order)}")
    for x in order:
        _choice(x, SECTIONS + tuple(items), f"{w}: order")
    fams = [i for i, x in enumerate(order) if x == "families" or x in {f.name for f in families}]
    where = lambda name: order.index(name) if name in order else order.index("families")  # noqa: E731
    placed = [(order.index(f.kind), x) for f in fits if f.kind in order  # a fit kind placed by itself
              for x in ([f.family] if f.kind == "growth" else [x.name for x in families] if f.kind == "power_law" else [])]
    if min(order.index("fits"), order.index("verdicts")) < max(fams) or any(at < where(x) for at, x in placed):
        raise StudyError(f"{w}: order: fits and verdicts read the families' comparisons, so families come before them")
    read = any(c.fit for o in outcomes for case in o.cases for x in case.when for c in x.parts())
    if read and order.index("verdicts") < max(order.index(x) for x in ("fits", "length_exponent") if x in order):
        raise StudyError(f"{w}: order: outcomes (printed with the verdicts) read the fits' tests, so fits come before "
                         f"verdicts")
    if order.index("paragraphs") < max(fams):
        raise StudyError(f"{w}: order: paragraphs read the families' comparisons, so families come before them")
    return order


def _grouped_fit(f: dict, kind: str, names: list[str], where: str) -> dict:
    """The ``length`` and ``threshold`` keys of a fit (``Fit``), checked."""
    def count(key: str, default: int) -> int:
        return _int_at_least(f.get(key, default), 1, f"{where}: {key}")

    def numbers(key: str, default: tuple) -> tuple:
        v = f.get(key, list(default))
        if not isinstance(v, list) or not v:
            raise StudyError(f"{where}: {key}: expected a non-empty list of numbers, got {v!r}")
        return tuple(_number(x, f"{where}: {key}") for x in v)

    takes_length = kind in ("length", "predict", "length_exponent")
    out = {"length": _names(f.get("length", "length"), names, f"{where}: length")[0] if takes_length else "length",
           "at": tuple(int(x) if float(x).is_integer() else x for x in numbers("at", (1000, 2000, 4000, 8000))),
           "rho": numbers("rho", (1.0, 2.0)), "min_cells": count("min_cells", 4), "min_groups": count("min_groups", 2),
           "unbounded": _number(f.get("unbounded", 10.0), f"{where}: unbounded"),
           "k3_star": _number(f.get("k3_star", 1e-3), f"{where}: k3_star"),
           "t_star": _number(f.get("t_star", 465.0), f"{where}: t_star"),
           "exponent": _number(f.get("exponent", -1.85), f"{where}: exponent", positive=False),
           "note": str(f.get("note", ""))}
    if kind == "predict" and "at_T" in f:
        out["at_T"] = _number(f["at_T"], f"{where}: at_T")
        out["at_k3"] = numbers("at_k3", ())
    if kind == "threshold":
        t = f.get("tokens")
        if not isinstance(t, dict) or not t:
            raise StudyError(f"{where}: kind threshold needs tokens: a mapping of group: T (the answer length where "
                             f"each group's k3*(T) is taken)")
        out["tokens"] = tuple((str(g), _number(v, f"{where}: tokens: {g}")) for g, v in t.items())
    return out


def _run_fit(f: dict, kind: str, names: list[str], families: list[Family], where: str) -> dict:
    """The ``growth`` and ``signals`` keys of a fit (``Fit``), checked."""
    def count(key: str, default: int) -> int:
        return _int_at_least(f.get(key, default), 0, f"{where}: {key}")

    def steps(key: str, default: tuple) -> tuple:
        v = f.get(key, list(default))
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and 0 <= v[0] <= v[1]):
            raise StudyError(f"{where}: {key}: expected [first step, last step], got {v!r}")
        return tuple(v)

    out: dict = {"min_falls": count("min_falls", 3)}
    if kind == "growth":
        for key in ("family", "fall", "headers"):
            if key not in f:
                raise StudyError(f"{where}: kind growth needs {key}")
        fam = _choice(f["family"], tuple(x.name for x in families), f"{where}: family")
        if not isinstance(f["headers"], list) or len(f["headers"]) != 6:
            raise StudyError(f"{where}: headers: the growth table has 6 columns, got {f['headers']!r}")
        out.update(family=fam, fall=_names(f["fall"], names, f"{where}: fall")[0],
                   margin=_number(f.get("margin", 0.02), f"{where}: margin"),
                   unmatched=_number(f.get("unmatched", 2.0), f"{where}: unmatched"),
                   headers=tuple(str(h) for h in f["headers"]))
    if kind == "signals":
        sigs = f.get("signals")
        if not isinstance(sigs, list) or not sigs:
            raise StudyError(f"{where}: kind signals needs signals: a list of {{name, metric, factor}}")
        parsed = []
        for i, x in enumerate(sigs):
            sw = f"{where}: signals[{i}]"
            x = _keys(x, ("name", "metric", "factor", "over", "power", "arms"), ("name", "metric"), sw)
            parsed.append(Signal(str(x["name"]), str(x["metric"]), _number(x.get("factor", 1.5), f"{sw}: factor"),
                                 str(x.get("over", "")), _number(x.get("power", 1), f"{sw}: power", positive=False),
                                 str(x.get("arms", ""))))
        out.update(signals=tuple(parsed), reference=steps("reference", (21, 60)), trail=count("trail", 10) or 1,
                   rise_after=count("rise_after", 60), early=count("early", 80), start=steps("start", (1, 5)))
    return out


def _exponent_fit(f: dict, kind: str, where: str) -> dict:
    """The ``length_exponent`` keys of a fit (``Fit``), checked (its ``groups`` are checked against
    the sweep's groups by ``engine.planned_runs``)."""
    if kind != "length_exponent":
        if "groups" in f:
            raise StudyError(f"{where}: groups: only kind length_exponent takes it, not kind {kind}")
        return {}
    for key in ("arm", "name"):
        if not isinstance(f.get(key), str) or not f[key]:
            raise StudyError(f"{where}: kind length_exponent needs {key}: " + (
                "the arm whose cost is fitted against T (e.g. spread)" if key == "arm" else
                "how the text names the fit (its tests are keyed by it)"))
    share = _number(f.get("max_undefined", 0.5), f"{where}: max_undefined", positive=False)
    if not 0 <= share < 1:
        raise StudyError(f"{where}: max_undefined: expected a share from 0 to below 1, got {share!r}")
    tests = []
    for i, t in enumerate(f.get("tests") or []):
        tw = f"{where}: tests[{i}]"
        t = _keys(t, ("name", "then", "otherwise", *INTERVAL_TESTS), ("name",), tw)
        conditions = []
        for key in INTERVAL_TESTS:
            v = t.get(key, [])
            for x in v if isinstance(v, list) else [v]:
                conditions.append((key, _number(x, f"{tw}: {key}", positive=False)))
        if not conditions:
            raise StudyError(f"{tw}: no condition; give one or more of {', '.join(INTERVAL_TESTS)} (e.g. holds: 1, "
                             f"excludes: 0)")
        tests.append(ExponentTest(str(t["name"]), tuple(conditions), str(t.get("then", "**yes**")),
                                  str(t.get("otherwise", "no"))))
    groups = f.get("groups", [])
    if not (isinstance(groups, list) and all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in groups)):
        raise StudyError(f"{where}: groups: expected a list of group values (e.g. [31, 109]), got {groups!r}")
    groups = [str(g) for g in groups]
    if "groups" in f and len(groups) < 2:
        raise StudyError(f"{where}: groups: an exponent needs at least 2 groups, got {groups}")
    if len(set(groups)) < len(groups):
        raise StudyError(f"{where}: groups: {next(g for g in groups if groups.count(g) > 1)} listed twice")
    return {"arm": f["arm"], "tests": tuple(tests), "max_undefined": share, "groups": tuple(groups)}


def _amendment(d: Any, where: str) -> Amendment:
    d = _keys(d, ("date", "reason", "hash"), ("date", "reason", "hash"), where)
    date = d["date"]
    try:
        date = (date if isinstance(date, datetime.date) else datetime.date.fromisoformat(str(date))).isoformat()
    except ValueError:
        raise StudyError(f"{where}: date {d['date']!r} is not a date (YYYY-MM-DD)") from None
    if not isinstance(d["reason"], str) or not d["reason"].strip():
        raise StudyError(f"{where}: reason must say why the registration changed")
    if not isinstance(d["hash"], str) or not re.fullmatch(r"[0-9a-f]{64}", d["hash"]):
        raise StudyError(f"{where}: hash must be the 64-hex-digit registration hash that `timlab study check` prints")
    return Amendment(date, d["reason"].strip(), d["hash"])


def canonical(obj: Any) -> str:
    """``obj`` as canonical JSON (sorted keys, no spaces): what the registration hash is taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _blocks(d: Any, w: str) -> tuple[Block, ...]:
    """The ``blocks`` list: each with a name, a machine label and its seeds; no seed in two blocks."""
    from timlab.machine import PINNED_LABELS

    if d is None:
        return ()
    if not isinstance(d, list) or len(d) < 2:
        raise StudyError(f"{w}: blocks: expected a list of at least two blocks (name, isa, seeds)")
    out, seen = [], {}
    for i, b in enumerate(d):
        where = f"{w}: blocks[{i}]"
        b = _keys(b, ("name", "isa", "seeds", "out", "fingerprint"), ("name", "isa", "seeds"), where)
        isa = _choice(b["isa"], PINNED_LABELS, f"{where}: isa")
        seeds = b["seeds"]
        if not (isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                          for x in seeds)):
            raise StudyError(f"{where}: seeds: expected a non-empty list of seeds (integers >= 0), got {seeds!r}")
        for x in seeds:
            if x in seen:
                raise StudyError(f"{where}: seeds: seed {x} is already in block {seen[x]!r}; a seed runs in one block")
            seen[x] = str(b["name"])
        fp = b.get("fingerprint", "")
        if not isinstance(fp, str):  # YAML reads 000000000000 as the integer 0, 123456789012 as a number
            raise StudyError(f"{where}: fingerprint: expected text, the 12 hex digits machine.fingerprint() gives, in "
                             f"quotes (e.g. '000000000000'), got {type(fp).__name__} {fp!r}")
        if fp and not re.fullmatch(r"[0-9a-f]{12}", fp):
            raise StudyError(f"{where}: fingerprint: expected the 12 hex digits machine.fingerprint() gives, got {fp!r}")
        out.append(Block(str(b["name"]), isa, tuple(seeds), str(b.get("out") or ""), fp))
    names = [b.name for b in out]
    if len(set(names)) < len(names):
        raise StudyError(f"{w}: blocks: two named {next(n for n in names if names.count(n) > 1)!r}")
    return tuple(out)


def registration_hash(registration: dict) -> str:
    """SHA-256 of a registration mapping (``Study.registration``) in canonical JSON."""
    return hashlib.sha256(canonical(registration).encode()).hexdigest()


def study_from_dict(d: Any, *, root: str | Path = ".", source: str = "<dict>", loading: tuple[str, ...] = ()) -> Study:
    """Validate a study mapping (``root``: the folder its relative paths start from; ``loading``: the
    study files whose fits are reading this one, so a cycle of ``study`` references is named)."""
    w = source
    d = _keys(d, STUDY_KEYS, ("study", "sweep", "steps", "endpoints", "families"), w)
    refuse_markers(d, w)
    sweep = d["sweep"]
    if isinstance(sweep, str):
        p = Path(root) / sweep
        if not p.exists():
            raise StudyError(f"{w}: sweep: spec file not found: {p}")
        sweep = load_yaml(read_text(p, what="sweep spec"), str(p), StudyError) or {}
        sweep_root, sweep_source = p.parent, str(p)
    else:
        sweep_root, sweep_source = Path(root), f"{source}: sweep"
    if not isinstance(sweep, dict):
        raise StudyError(f"{w}: sweep: expected a spec file name or an inline spec mapping")
    steps = _int_at_least(d["steps"], 1, f"{w}: steps")
    if not isinstance(d["endpoints"], list) or not d["endpoints"]:
        raise StudyError(f"{w}: endpoints: expected a non-empty list")
    endpoints: list[Endpoint] = []
    for i, e in enumerate(d["endpoints"]):
        endpoints.append(_endpoint(e, f"{w}: endpoints[{i}]", [x.name for x in endpoints]))
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise StudyError(f"{w}: endpoints: duplicate name {next(n for n in names if names.count(n) > 1)!r}")
    rules = []
    if not isinstance(d.get("rules") or [], list):
        raise StudyError(f"{w}: rules: expected a list")
    for i, r in enumerate(d.get("rules") or []):
        where = f"{w}: rules[{i}]"
        r = _keys(r, ("name", "test", "alpha", "holds", "fails", "opposite", "requires", "unmet", "ratio_bound",
                      "interval", "margin", "margin_of"), ("name",), where)
        alpha = _number(r.get("alpha", 0.05), f"{where}: alpha")
        if alpha >= 1:
            raise StudyError(f"{where}: alpha must be below 1, got {alpha}")
        test = _choice(r.get("test", "below"), TESTS, f"{where}: test")
        if test in MARGIN_TESTS:
            for key in ("margin", "margin_of"):
                if key not in r:
                    raise StudyError(f"{where}: test {test} needs {key} (the margin is margin x the cost of the arm "
                                     f"margin_of, e.g. margin: 0.5, margin_of: spread)")
            if not isinstance(r["margin_of"], str) or not r["margin_of"]:
                raise StudyError(f"{where}: margin_of: expected an arm's name, got {r['margin_of']!r}")
        else:
            for key in ("margin", "margin_of"):
                if key in r:
                    raise StudyError(f"{where}: {key}: only the margin tests ({', '.join(MARGIN_TESTS)}) take it, "
                                     f"not test {test}")
        rules.append(Rule(str(r["name"]), test, alpha,
                          str(r.get("holds", "**yes**")), str(r.get("fails", "no")), str(r.get("opposite", "")),
                          str(r.get("requires", "")), str(r.get("unmet", "")), bool(r.get("ratio_bound", False)),
                          bool(r.get("interval", True)),
                          _number(r["margin"], f"{where}: margin") if test in MARGIN_TESTS else 0.0,
                          str(r.get("margin_of", ""))))
    rule_names = [r.name for r in rules]
    _unique(rule_names, f"{w}: rules")
    for i, r in enumerate(rules):
        if r.requires:
            _choice(r.requires, tuple(n for n in rule_names if n != r.name), f"{w}: rules[{i}]: requires")
    control = str(d.get("control", "control"))
    families = []
    for i, f in enumerate(d["families"] if isinstance(d["families"], list) and d["families"] else [None]):
        where = f"{w}: families[{i}]"
        families.append(_family(f, where, names, tuple(rule_names), control, {r.name: r for r in rules}))
    _unique([f.name for f in families], f"{w}: families")
    tables = []
    for i, t in enumerate(d.get("tables") or []):
        where = f"{w}: tables[{i}]"
        t = _keys(t, ("title", "columns", "note", "name", "after", "arm_header", "names", "align"), ("columns",), where)
        if not isinstance(t.get("names") or {}, dict):
            raise StudyError(f"{where}: names: expected a mapping of arm: text")
        cols = []
        for j, c in enumerate(t["columns"] if isinstance(t["columns"], list) else [None]):
            cw = f"{where}: columns[{j}]"
            c = _keys(c, ("header", "show", "endpoint", "endpoints", "digits", "format", "ranges", "otherwise",
                          "control", "by", "power", "ci", "partial"), ("header", "show"), cw)
            show = _choice(c["show"], SHOWS, f"{cw}: show")
            eps = _names(c.get("endpoints", c.get("endpoint")), names, f"{cw}: endpoint")
            two = show in ("change", "pair")
            if show != "nonzero" and len(eps) != (2 if two else 1):
                raise StudyError(f"{cw}: show {show} takes {'two endpoints' if two else 'one endpoint'}")
            ranges = _ranges(c.get("ranges"), f"{cw}: ranges") if show == "range" else ()
            digits = c.get("digits", 3)
            if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= 8:
                raise StudyError(f"{cw}: digits must be an integer from 0 to 8, got {digits!r}")
            spec = bounded_spec(str(c.get("format", "")), f"{cw}: format")
            try:
                format(1.0, spec)
            except ValueError:
                raise StudyError(f"{cw}: format {spec!r} is not a Python format spec for a number (e.g. .1f)") from None
            if show == "scaled" and "by" not in c:
                raise StudyError(f"{cw}: show scaled needs by: the endpoint whose control mean scales the mean")
            by = _names(c["by"], names, f"{cw}: by")[0] if show == "scaled" else ""
            bounded_fields(str(c.get("partial", "")), f"{cw}: partial")
            try:
                str(c.get("partial", "")).format(k=1, n=2)
            except (KeyError, IndexError, ValueError) as e:
                raise StudyError(f"{cw}: partial: not a format string of {{k}} and {{n}} ({e})") from None
            cols.append(Column(str(c["header"]), show, eps, digits, spec, ranges, str(c.get("otherwise", "")),
                               None if c.get("control") is None else str(c["control"]), by,
                               _number(c.get("power", 1), f"{cw}: power", positive=False), bool(c.get("ci", True)),
                               str(c.get("partial", ""))))
        tables.append(Table(str(t.get("title", "")), tuple(cols), str(t.get("arm_header", "arm")),
                            str(t.get("note", "")), str(t.get("name", "")), str(t.get("after", "")),
                            tuple((str(a), str(x)) for a, x in (t.get("names") or {}).items()),
                            _choice(t.get("align", "auto"), ALIGNS, f"{where}: align")))
    fits = []
    for i, f in enumerate(d.get("fits") or []):
        where = f"{w}: fits[{i}]"
        f = _keys(f, ("kind", "endpoint", "arms", "k3", "loss", "what", "k3_ref", "name", "dose_label", "study", "title",
                      "length", "at", "rho", "min_cells", "min_groups", "unbounded", "tokens", "k3_star", "t_star",
                      "exponent", "note", "at_T", "at_k3", "family", "fall", "min_falls", "margin", "unmatched",
                      "headers", "signals", "reference", "trail", "rise_after", "early", "start", "arm", "tests",
                      "max_undefined", "groups"), ("kind", "endpoint"), where)
        kind = _choice(f["kind"], FITS, f"{where}: kind")
        if (kind in GROUPED_FITS) != bool(d.get("groups")):
            raise StudyError(f"{where}: kind {kind} " + ("needs groups: (a grouped study)" if kind in GROUPED_FITS
                             else "fits arms of an ungrouped study; with groups: use " + " or ".join(GROUPED_FITS)))
        if kind not in (*GROUPED_FITS, "growth", "signals") and "arms" not in f:
            raise StudyError(f"{where}: missing key 'arms'")
        eps = _names(f["endpoint"], names, f"{where}: endpoint")
        ep = eps[0]
        if len(eps) > 1 and kind != "place":
            raise StudyError(f"{where}: endpoint: kind {kind} fits one endpoint, got {list(eps)}")
        labels = f.get("name", "")
        labels = labels if isinstance(labels, list) else [labels] * len(eps)
        if len(labels) != len(eps):
            raise StudyError(f"{where}: name: one per endpoint ({len(eps)}), got {len(labels)}")
        k3 = _names(f.get("k3", "k3"), names, f"{where}: k3")[0]
        other = ""
        if kind in ("place", "predict"):
            if not f.get("study"):
                raise StudyError(f"{where}: kind {kind} needs study: the file of the study whose "
                                 + ("law it places arms against" if kind == "place" else "length fit it tests"))
            other = str(Path(root) / f["study"])
            chain = (*loading, source)
            if any(Path(x).resolve() == Path(other).resolve() for x in chain if Path(x).is_file()):
                raise StudyError(f"{where}: study: {other} references this study itself ("
                                 f"{' -> '.join((*chain, other))}); a {kind} fit reads another study")
            o = load_study(other, loading=chain)
            if bool(o.groups) != (kind == "predict"):
                raise StudyError(f"{where}: study: {other} is {'an ungrouped' if kind == 'predict' else 'a grouped'} "
                                 f"study; {kind} needs {'a grouped' if kind == 'predict' else 'an ungrouped'} one")
            if kind == "predict":
                _names([f.get("length", "length")], [x.name for x in o.endpoints], f"{where}: length (an endpoint of "
                                                                                   f"{other} too)")
            for key, e in [("endpoint", e) for e in eps] + [("k3", k3)]:
                _choice(e, tuple(x.name for x in o.endpoints), f"{where}: {key} (an endpoint of {other} too)")
        fits.append(Fit(kind, ep, str(f.get("arms", "")), k3, _number(f.get("loss", 0.1), f"{where}: loss"),
                        str(f.get("what", "")), _number(f.get("k3_ref", 1e-3), f"{where}: k3_ref"),
                        str(labels[0]), str(f.get("dose_label", "head_perturb")), other, str(f.get("title", "")), eps,
                        tuple(str(x) for x in labels), **_grouped_fit(f, kind, names, where),
                        **_run_fit(f, kind, names, families, where), **_exponent_fit(f, kind, where)))
    named = [f.name for f in fits if f.kind == "length_exponent"]
    twice = [n for n in named if named.count(n) > 1]
    if twice:
        raise StudyError(f"{w}: fits: two length_exponent fits named {twice[0]!r}; each needs its own name (its "
                         f"tests are keyed by it)")
    v = _keys(d.get("validity") or {}, ("control_exact", "min_start_accuracy", "same_start", "start_bar", "title",
                                        "runs", "controls"), (), f"{w}: validity")
    controls = v.get("controls") or []
    if not (isinstance(controls, list) and all(isinstance(a, str) for a in controls)):
        raise StudyError(f"{w}: validity: controls: expected a list of arm names, got {controls!r}")
    bar, start_bar = v.get("min_start_accuracy"), v.get("start_bar")
    validity = Validity(bool(v.get("control_exact", True)),
                        None if bar is None else _number(bar, f"{w}: validity: min_start_accuracy", positive=False),
                        bool(v.get("same_start", False)),
                        None if start_bar is None else _number(start_bar, f"{w}: validity: start_bar", positive=False),
                        str(v.get("title", "Validity")), str(v.get("runs", "")), tuple(controls))
    findings, blank_end = None, False
    if d.get("findings") is not None:
        fd = _keys(d["findings"], ("file", "block", "blank_end"), ("file", "block"), f"{w}: findings")
        findings, blank_end = (str(Path(root) / fd["file"]), str(fd["block"])), bool(fd.get("blank_end", False))
    arm_pattern = str(d.get("arm_pattern") or "")
    if arm_pattern:
        try:
            ok = "arm" in re.compile(arm_pattern).groupindex
        except re.error as e:
            raise StudyError(f"{w}: arm_pattern: not a regular expression ({e})") from None
        if not ok:
            raise StudyError(f"{w}: arm_pattern: needs a group named arm, e.g. v1_(?P<arm>.+)_s\\d+")
    groups = str(d.get("groups") or "")
    if bool(groups) != ("group" in (re.compile(arm_pattern).groupindex if arm_pattern else {})):
        raise StudyError(f"{w}: groups: {'set' if groups else 'unset'}, but arm_pattern "
                         f"{'has no' if groups else 'has a'} group named group; a grouped study needs both, e.g. "
                         f"groups: level with arm_pattern: v(?P<group>\\d+)_(?P<arm>.+)_s\\d+")
    if groups and d.get("verdicts"):
        raise StudyError(f"{w}: verdicts: not available in a grouped study (groups: {groups}); use the families' rules")
    repeats = None
    if d.get("repeats") is not None:
        r = _keys(d["repeats"], ("sweep", "last_step"), ("sweep", "last_step"), f"{w}: repeats")
        last = r["last_step"]
        if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last <= steps:
            raise StudyError(f"{w}: repeats: last_step must be an integer from 0 to steps ({steps}), got {last!r}")
        repeats = Repeats(str(r["sweep"]), last)
    verdicts = tuple(_verdict(x, f"{w}: verdicts[{i}]", families) for i, x in enumerate(d.get("verdicts") or []))
    _unique([v.name for v in verdicts], f"{w}: verdicts")
    _unique([t.name for t in tables if t.name], f"{w}: tables")
    if not isinstance(d.get("outcomes") or [], list):
        raise StudyError(f"{w}: outcomes: expected a list")
    outcomes = tuple(_outcome(x, f"{w}: outcomes[{i}]", families, fits, bool(groups))
                     for i, x in enumerate(d.get("outcomes") or []))
    twice = [o.name for o in outcomes if [x.name for x in outcomes].count(o.name) > 1]
    if twice:
        raise StudyError(f"{w}: outcomes: two named {twice[0]!r}; each needs its own name")
    order = _order(d.get("order"), families, tables, fits, verdicts, w, outcomes)
    notes = d.get("notes") or []
    if not (isinstance(notes, list) and all(isinstance(x, str) for x in notes)):
        raise StudyError(f"{w}: notes: expected a list of paragraphs (text)")
    paragraphs = tuple(_paragraph(x, f"{w}: paragraphs[{i}]", families, names, bool(groups))
                       for i, x in enumerate(d.get("paragraphs") or []))
    amendments = tuple(_amendment(a, f"{w}: amendments[{i}]") for i, a in enumerate(d.get("amendments") or []))
    for i in range(1, len(amendments)):
        if amendments[i].date < amendments[i - 1].date:
            raise StudyError(f"{w}: amendments[{i}]: dated {amendments[i].date}, before amendments[{i - 1}] "
                             f"({amendments[i - 1].date}); amendments are listed oldest first")
    frozen = d.get("frozen", "")
    if not isinstance(frozen, str):  # YAML reads a hash of decimal digits alone as a number
        raise StudyError(f"{w}: frozen: expected text, the 64-hex-digit registration hash in quotes, got "
                         f"{type(frozen).__name__} {frozen!r}")
    if frozen and not re.fullmatch(r"[0-9a-f]{64}", str(frozen)):
        raise StudyError(f"{w}: frozen must be a 64-hex-digit registration hash, got {frozen!r}")
    predicted_by = None
    if d.get("predicted_by") is not None:
        pb = _keys(d["predicted_by"], ("study", "kinds", "probe"), ("study", "kinds", "probe"), f"{w}: predicted_by")
        kinds = pb["kinds"]
        if not (isinstance(kinds, dict) and kinds and all(isinstance(x, str) and x for x in kinds.values())):
            raise StudyError(f"{w}: predicted_by.kinds: expected a mapping arm -> kind of mismatch, got {kinds!r}")
        if control in kinds:
            raise StudyError(f"{w}: predicted_by.kinds: the control {control!r} is not a cell")
        if not (Path(root) / str(pb["study"])).is_file():
            raise StudyError(f"{w}: predicted_by.study: predictor study file not found: {Path(root) / str(pb['study'])}")
        predicted_by = PredictedBy(str(Path(root) / str(pb["study"])), {str(k): v for k, v in kinds.items()},
                                   str(pb["probe"]))
    registration = {k: v for k, v in d.items() if k not in UNHASHED}
    registration["sweep"] = _with_config(sweep, sweep_root, w)
    return Study(name=str(d["study"]), sweep=sweep, sweep_root=str(sweep_root), sweep_source=sweep_source, steps=steps,
                 endpoints=tuple(endpoints), families=tuple(families),
                 rules=tuple(rules), control=control, groups=groups, out=str(d.get("out") or ""), validity=validity,
                 tables=tuple(tables), fits=tuple(fits), findings=findings, blank_end=blank_end, arm_pattern=arm_pattern,
                 repeats=repeats, verdicts=verdicts, outcomes=outcomes, order=order, frozen=str(frozen),
                 amendments=amendments,
                 notes=tuple(notes), paragraphs=paragraphs, source=source, hash=registration_hash(registration),
                 registration=registration, predicted_by=predicted_by, blocks=_blocks(d.get("blocks"), w))


def _with_config(sweep: dict, root: Path, w: str) -> dict:
    """The sweep spec as the registration hashes it: with its ``base.config`` file's content (its
    YAML mapping) in place of the file's name, so a change inside that file is a change of the
    registration (a spec without ``base.config`` is hashed as written, as before)."""
    base = sweep.get("base")
    if not (isinstance(base, dict) and isinstance(base.get("config"), str)):
        return sweep
    p = Path(base["config"]) if Path(base["config"]).is_absolute() else Path(root) / base["config"]
    if not p.is_file():
        raise StudyError(f"{w}: sweep: base.config file not found: {p}")
    content = load_yaml(read_text(p, what="base config"), str(p), StudyError) or {}
    return {**sweep, "base": {**base, "config": content}}


def study_mapping(path: str | Path) -> tuple[Path, dict]:
    """A study file's path and its YAML mapping, read once (every kind of study file: ``load_study``, the
    predictor and held-out studies' loaders)."""
    p = Path(path)
    if not p.is_file():
        raise StudyError(f"study file not found: {p}")
    return p, load_yaml(read_text(p, what="study file"), str(p), StudyError) or {}


def load_study(path: str | Path, *, loading: tuple[str, ...] = ()) -> Study:
    """Read and validate a study file (``loading``: see ``study_from_dict``)."""
    p, d = study_mapping(path)
    return study_from_dict(d, root=p.parent, source=str(p), loading=loading)


# ------------------------------------------------------------------------------ the freeze
def _first_difference(old: Any, new: Any, where: str = "") -> str:
    """The first path at which two registrations differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            if canonical(old.get(k)) != canonical(new.get(k)):
                return _first_difference(old.get(k), new.get(k), f"{where}.{k}" if where else str(k))
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if canonical(a) != canonical(b):
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where or 'the registration'}: {canonical(old)} -> {canonical(new)}"


def frozen_record(out: str | Path) -> dict | None:
    """The freeze record in a sweep directory, or None."""
    p = Path(out) / FREEZE_FILE
    if not p.exists():
        return None
    try:
        rec = json.loads(read_text(p, what="freeze record"))
    except json.JSONDecodeError as e:
        raise StudyError(f"{p}: not JSON ({e.msg}); it records the registration frozen at the first run") from None
    if not isinstance(rec, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(rec.get("hash", ""))):
        raise StudyError(f"{p}: no registration hash in it")
    return rec


def holds_runs(out: str | Path) -> bool:
    """Whether a sweep directory holds runs: its index, or any run folder (a folder holding a
    config.yaml and a status.json, as every run leaves from its first step), so a sweep whose index
    was deleted still counts as run and no registration is frozen over its runs."""
    from timlab.experiments.sweeps.index import INDEX_FILE
    from timlab.rundir import CONFIG, STATUS

    d = Path(out)
    if (d / INDEX_FILE).exists():
        return True
    try:
        children = list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any((c / CONFIG).is_file() and (c / STATUS).is_file() for c in children if c.is_dir())


def check_freeze(study: Study, out: str | Path, *, has_runs: bool) -> str:
    """Raise ``StudyError`` unless ``study``'s registration is the one frozen at its first run (or
    the last amendment's); return a line saying which. ``has_runs``: the sweep has runs, so a
    registration that was never frozen is refused too."""
    rec = frozen_record(out)
    frozen = rec["hash"] if rec else study.frozen
    if not frozen:
        if has_runs:
            raise StudyError(f"{study.source}: {out} holds runs but no frozen registration (no {FREEZE_FILE}, no "
                             f"frozen:); start runs with `timlab study run`, or record the hash they were registered "
                             f"with as frozen: {study.hash}")
        return "not frozen yet (no run)"
    _check_recorded(study, rec, out)
    if study.hash == frozen:
        return f"frozen registration {frozen[:12]} unchanged"
    last = study.amendments[-1] if study.amendments else None
    if last is not None and study.hash == last.hash:
        at = (rec or {}).get("frozen_at")
        for i, a in applied_amendments(study, frozen):
            if at and a.date < str(at):
                raise StudyError(f"{study.source}: amendments[{i}]: dated {a.date}, before the registration was frozen "
                                 f"at the first run ({at}, {Path(out) / FREEZE_FILE}); an amendment is made after it")
        return f"frozen registration {frozen[:12]}, amended {last.date} ({len(study.amendments)} amendment(s)): {last.reason}"
    what = _first_difference(rec["registration"], study.registration) if rec and "registration" in rec else \
        "no frozen copy to compare"
    raise StudyError(f"{study.source}: the registration changed after its first run (frozen {frozen[:12]}, now "
                     f"{study.hash[:12]}; {what}); record an amendment with date, reason and hash: {study.hash}")


def applied_amendments(study: Study, frozen: str) -> list[tuple[int, Amendment]]:
    """The (index, amendment) pairs that amend the registration frozen as ``frozen``: those after
    the last amendment whose hash is ``frozen`` (a block frozen at an amended registration), else all."""
    k = max((i for i, a in enumerate(study.amendments) if a.hash == frozen), default=-1)
    return list(enumerate(study.amendments))[k + 1:]


def _check_recorded(study: Study, rec: dict | None, out: str | Path) -> None:
    """Each amendment the freeze record holds (``record_amendments``: recorded when first used) must
    still be in the study file as it was then: an amendment once used is never edited or removed."""
    listed = {(a.date, a.reason, a.hash) for a in study.amendments}
    for i, r in enumerate((rec or {}).get("amendments") or []):
        if not isinstance(r, dict) or (str(r.get("date")), str(r.get("reason")), str(r.get("hash"))) not in listed:
            what = f"{r.get('date')} (hash {str(r.get('hash'))[:12]})" if isinstance(r, dict) else repr(r)
            raise StudyError(f"{study.source}: amendments: the amendment of {what} that {Path(out) / FREEZE_FILE} "
                             f"recorded when it was first used is no longer in the file as it was; an amendment once "
                             f"used is not edited or removed (add a new one)")


def record_amendments(study: Study, out: str | Path) -> int:
    """Record in ``<out>/study.json`` each amendment that amends its frozen registration (its date,
    reason, hash and the day it was first used) and is not recorded yet, once ``check_freeze``
    passed; returns how many it added. Without a ``study.json`` (a sweep frozen by ``frozen:`` in
    the file) nothing is recorded."""
    rec = frozen_record(out)
    if rec is None or study.hash == rec["hash"]:
        return 0
    from timlab.files import atomic_write_text

    have = rec.get("amendments") or []
    seen = {(r.get("date"), r.get("reason"), r.get("hash")) for r in have if isinstance(r, dict)}
    new = [{"date": a.date, "reason": a.reason, "hash": a.hash, "first_used": datetime.date.today().isoformat()}
           for _, a in applied_amendments(study, rec["hash"]) if (a.date, a.reason, a.hash) not in seen]
    if new:
        rec["amendments"] = [*have, *new]
        atomic_write_text(Path(out) / FREEZE_FILE, json.dumps(rec, indent=1, default=str) + "\n")
    return len(new)


def input_digests(study: Study) -> dict[str, str]:
    """{file: SHA-256} of the files the sweep's runs read that the registration names only by their
    path: each regular file directly in a run's ``model.path`` and ``model.pretrain_init`` folder
    (config.json, the weights, the tokenizer), and the dataset task's ``task.kwargs.path``. A path
    that does not exist (yet) is left out."""
    import stat

    from timlab.experiments.sweeps.spec import expand, spec_from_dict
    from timlab.files import sha256_file

    def regular(p: Path) -> bool:  # never a FIFO or a device: reading one could block or never end
        try:
            return stat.S_ISREG(p.stat().st_mode)
        except OSError:
            return False

    spec = spec_from_dict(study.sweep, root=study.sweep_root, source=study.sweep_source)
    files: set[Path] = set()
    for r in expand(spec):
        m, task = r.config.model, r.config.task
        for folder in (Path(x) for x in (m.path, m.pretrain_init) if x):
            if folder.is_dir():
                files.update(f for f in folder.iterdir() if regular(f))
        if task.name == "dataset" and task.kwargs.get("path") and regular(Path(task.kwargs["path"])):
            files.add(Path(task.kwargs["path"]))
    return {str(f): sha256_file(f) for f in sorted(files)}


def check_inputs(study: Study, out: str | Path) -> str:
    """Compare ``input_digests`` with those ``<out>/study.json`` recorded for this registration
    (keyed by its hash: an amendment may name other inputs), raising ``StudyError`` at the first
    that changed, or record them when none are recorded yet (their first use); a line saying which.
    Run by ``timlab study run`` only: the inputs are local files (a start in ``runs/`` is not
    committed, and each machine block makes its own), which an analysis never reads."""
    rec = frozen_record(out)
    if rec is None:
        return "inputs not recorded (no study.json)"
    now, have = input_digests(study), (rec.get("inputs") or {}).get(study.hash)
    if have is None:
        from timlab.files import atomic_write_text

        rec["inputs"] = {**(rec.get("inputs") or {}), study.hash: now}
        atomic_write_text(Path(out) / FREEZE_FILE, json.dumps(rec, indent=1, default=str) + "\n")
        return f"{len(now)} input file(s) recorded"
    for f in sorted(set(have) | set(now)):
        if have.get(f) != now.get(f):
            what = ("is gone" if f not in now else "is new" if f not in have else
                    f"changed (SHA-256 {have[f][:12]} -> {now[f][:12]})")
            raise StudyError(f"{study.source}: input {f} {what} since the registration was frozen in "
                             f"{Path(out) / FREEZE_FILE}; its runs would read other data than the runs made so far")
    return f"{len(now)} input file(s) as frozen"


def freeze(study: Study, out: str | Path) -> bool:
    """Record ``study``'s registration in ``<out>/study.json`` before the first run; once a record
    exists (or the file names ``frozen``), check against it instead; a sweep that already holds runs
    without either is refused (its registration was never frozen). Returns whether it wrote one."""
    if frozen_record(out) is not None or study.frozen or holds_runs(out):
        check_freeze(study, out, has_runs=True)  # runs made without a freeze: refused unless frozen: is set
        record_amendments(study, out)
        check_inputs(study, out)
        return False
    from timlab.files import atomic_write_with

    Path(out).mkdir(parents=True, exist_ok=True)
    rec = {"study": study.name, "hash": study.hash, "frozen_at": datetime.date.today().isoformat(),
           "source": study.source, "registration": study.registration, "inputs": {study.hash: input_digests(study)}}
    atomic_write_with(Path(out) / FREEZE_FILE, lambda tmp: Path(tmp).write_text(json.dumps(rec, indent=1, default=str) + "\n"))
    return True
