"""The generated blocks of docs/FINDINGS.md and its pages (docs/findings/*.md), recomputed from the
committed sweeps under sweeps/: ``BLOCKS`` maps each ``<!-- findings:NAME -->`` marker to the
function that writes its body and ``render`` runs them all (``timlab.experiments.studies.text.spliced``
puts them into the files).
``python scripts/findings_tables.py`` (print, ``--write``, ``--check``) is the command over this,
and ``tests/test_findings.py`` fails when the committed text differs from what it computes.

The modules, by subject: ``common`` (paths, number formats, the surge testbed's per-run table),
``surge`` (the surge testbed, its verdict tests, P3 and the collapse threshold), ``studies`` (the
per-study descriptive blocks), ``e3``, ``erosion``, ``moe`` and ``harm2`` (tables of those studies'
sweeps, also printed by their own scripts). Blocks of studies written as study files come from
their analyses (``study_blocks``).
"""

from __future__ import annotations

import functools

import pandas as pd

from timlab.experiments.studies import early_warning, early_warning2
from timlab.experiments.studies.engine import analyze, predictions
from timlab.experiments.studies.findings_blocks import e3, erosion, harm2, moe
from timlab.experiments.studies.findings_blocks.common import ROOT, STUDIES, SWEEPS, load_runs
from timlab.experiments.studies.findings_blocks.studies import (e3c_reading, h1_k3_steps, harm2_k3_steps,
                                                                l1_against_e3b, l1_k3_steps, late_falls_k3,
                                                                p1_pairs, p2_amd, p2_persistence)
from timlab.experiments.studies.findings_blocks.surge import d16_300, p3, surge_conditions, threshold, verdict_tests
from timlab.experiments.studies.heldout import analyze_heldout, blocks as heldout_blocks, load_heldout
from timlab.experiments.studies.oos import blocks as predictor_study_blocks
from timlab.experiments.studies.predictor import load_predictor
from timlab.experiments.studies.registration import load_study
from timlab.findings import INDEX

FINDINGS = INDEX
"""The findings index; its pages (docs/findings/*.md) hold most blocks."""

BLOCKS = {"surge-conditions": surge_conditions, "verdict-tests": verdict_tests, "p3": p3, "threshold": threshold,
          "d16-300": d16_300, "l1-k3-steps": l1_k3_steps, "p1-pairs": p1_pairs, "p2-persistence": p2_persistence,
          "erosion-probe": lambda R: erosion.probe(str(SWEEPS / "erosion_probe")),
          "erosion-pilot": lambda R: erosion.slopes(str(SWEEPS / "erosion_pilot"), erosion.START),
          "e3-starts": lambda R: e3.starts(str(SWEEPS / "e3_starts")),
          "e3-followup": lambda R: e3.followup(str(SWEEPS / "e3_starts_rl")),
          "e3b-probe": lambda R: erosion.probe(str(SWEEPS / "e3b_probe")),
          "e3c-predictions": lambda R: predictions(load_study(STUDIES / "e3c.yaml"), root=ROOT),
          # E3c's study file names no FINDINGS block, and adding one would change its frozen registration's hash,
          # so its analysis is spliced here
          "e3c-study": lambda R: analyze(load_study(STUDIES / "e3c.yaml"), root=ROOT).text,
          # Study H1 as the early-warning benchmark's second test set (its INCOMPLETE line until H1 is complete)
          "early-warning-h1": lambda R: early_warning.format_test_set(early_warning.second_test(SWEEPS, "h1")),
          "early-warning-2": lambda R: early_warning2.report(SWEEPS),  # INCOMPLETE until Study LF is complete
          "moe-learn": lambda R: moe.learn(str(SWEEPS / "surge_moe_learn")),
          "moe-pilot": lambda R: moe.arms(str(SWEEPS / "moe_pilot")),
          "moe-calib": lambda R: moe.arms(str(SWEEPS / "moe_calib")),
          "p2-amd": p2_amd,
          "harm2-k3-steps": harm2_k3_steps,
          "harm2-pilot": lambda R: harm2.pilot_table(SWEEPS / "harm2_pilot"),
          "e3c-reading": e3c_reading, "l1-e3b": l1_against_e3b, "h1-k3-steps": h1_k3_steps,
          "late-falls-k3": late_falls_k3}
"""The generated blocks of the findings (docs/FINDINGS.md and its pages), by marker name (with ``study_blocks``)."""


def study_blocks() -> dict:
    """{FINDINGS block: its study file's analysis} of every study file under ``STUDIES`` (sweep
    directories relative to the repository)."""
    out = {}
    for path in sorted(STUDIES.glob("*.yaml")):
        hst = load_heldout(path)
        if hst is not None:  # a held-out predictor study (Study H2): two blocks from one analysis
            if hst.findings:
                once = functools.cache(lambda hst=hst: heldout_blocks(hst, analyze_heldout(hst, root=ROOT)))
                out.update({name: (lambda R, name=name, once=once: once()[name]) for name in hst.findings[1:]})
            continue
        pst = load_predictor(path)
        if pst is not None and pst.findings:  # a predictor study (Study H): two blocks from one analysis
            once = functools.cache(lambda pst=pst: predictor_study_blocks(pst))
            out.update({name: (lambda R, name=name, once=once: once()[name]) for name in pst.findings[1:]})
        elif pst is None and (s := load_study(path)).findings:
            out[s.findings[1]] = lambda R, s=s: analyze(s, root=ROOT).text
    return out


BLOCKS.update(study_blocks())


def render(R: pd.DataFrame | None = None) -> dict[str, str]:
    R = load_runs() if R is None else R
    return {name: fn(R) for name, fn in BLOCKS.items()}
