"""A study file's schema: the names of its valid choices, ``StudyError``, and the frozen dataclasses
each section of the file is read into (``Study`` holds them all). ``sections`` and ``entries`` read
the file into these; ``registration`` puts them together and freezes the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from timlab.errors import TimlabError

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
