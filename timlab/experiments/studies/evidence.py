"""The lab's measured cells as one evidence record: what each studied mismatch was, and what it cost.

Read by ``timlab.experiments.diagnostics.harm_prediction`` (the answer ``timlab check`` and ``timlab analyze``
print); written by ``python scripts/harm_evidence.py --write`` into ``timlab/data/harm_evidence.json``,
and tests/test_harm_evidence.py fails when the committed record differs from what this module
computes from the committed sweeps. Nothing here is a new analysis: each cost is the one its study
defines, read with that study's own code.

Sources (``SOURCES``), each cell a (group, arm) of one committed sweep against its own control:

- Study H's in-sample cells and the arms beside its fit (E1, E2, E3, E3b, MoE; the predictor study
  ``docs/examples/studies/harm.yaml``, read with ``predictor.source_runs`` / ``source_cells``, every
  committed seed) and its out-of-sample cells (``harm_oos.yaml``);
- Studies P1, P2, H1 and H2 (their study files, read with ``engine.endpoint_values``; H1's two
  machine blocks are its registered blocks; H2's cells are its runs study's 14 arms, 7 kinds at doses
  chosen by what they cost).

Per cell: the **cost** is the control's mean minus the arm's mean of each run's mean
``val/accuracy`` over the study's cost window (Study H's 50-150 for its cells, P1's and P2's
registered 50-150, H1's 1500-2000), with the 95% percentile bootstrap interval of that difference
(``stats.bootstrap_diff_ci``: each side's seeds resampled on their own) and the exact permutation
p of one comparison (``stats.compare_family``; within machine blocks for H1). A cost is
**detectable** when the arm's level is below the control's with p < 0.05 and the interval lies
above 0 (``Comparison.above`` of the control over the arm), uncorrected: a cell is evidence on its
own here, not a member of its study's Holm family. The **realized k3** (``rollout_corr/k3_kl``),
the **answer length** T (``train/response_length_mean``) and ``mismatch/persistence_ema`` are each
run's mean over training steps 10 to the end of the cost window (``k3_window``), then the mean
over the arm's runs; persistence is None where no run logged it (P2's comes from its bit-identical
re-run ``sweeps/p2_rerun``, which did). The **kind** is read from the arm's config
(``kind_of``), the model's **parameter count** from its architecture (``config_params``), and
**falls** counts the arm's runs that fell by the plateau rule (``timlab.experiments.studies.collapse``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timlab.experiments.studies.stats import compare_family

EVIDENCE = Path(__file__).resolve().parents[2] / "data" / "harm_evidence.json"
"""The committed record (``timlab.experiments.diagnostics.harm_prediction`` reads it)."""

K3 = "rollout_corr/k3_kl"
LENGTH = "train/response_length_mean"
PERSISTENCE = "mismatch/persistence_ema"
COST_METRIC = "val/accuracy"
FIRST_STEP = 10
"""First training step of the k3, length and persistence windows (P1's and P2's descriptive window)."""

FAMILY = {"head_perturb": "head", "stale": "stale", "precision": "numerical", "weight_rounding": "numerical", "fp8": "numerical",
          "kv_cache": "kv_cache", "router_precision": "router", "logit_noise": "logit_noise",
          "temperature": "temperature"}
"""Injector -> the kind family a user can state (``timlab analyze --kind``); Study H's kind names."""


@dataclass(frozen=True)
class StudySource:
    """One ordinary study file whose arms are cells."""

    name: str
    """How the record names the study's cells, e.g. ``P1`` (``P1/persist``)."""
    source: str
    """How the answer names where a cell comes from, e.g. ``Study P1``."""
    file: str
    """Its study file, relative to the repository root."""
    cost: str
    """The endpoint that is the cost's per-run value (a ``level`` of ``val/accuracy``)."""
    arms: tuple = ()
    """The arms that are cells (empty: every arm but the control)."""
    persistence_out: str = ""
    """A sweep of the same runs, re-run bit for bit with the persistence metrics, to read them from."""


HARM = "docs/examples/studies/harm.yaml"
"""Study H's predictor study: its in-sample sources are cells."""

SOURCES = (
    StudySource("H-oos", "Study H, out of sample", "docs/examples/studies/harm_oos.yaml", "acc"),
    StudySource("P1", "Study P1", "docs/examples/studies/p1.yaml", "acc_level"),
    StudySource("P2", "Study P2", "docs/examples/studies/p2.yaml", "acc_level", persistence_out="sweeps/p2_rerun"),
    StudySource("H1", "Study H1", "docs/examples/studies/h1.yaml", "acc_late"),
    StudySource("H2", "Study H2", "docs/examples/studies/harm2_runs.yaml", "acc"),
)
"""The ordinary studies whose arms are cells, after Study H's in-sample cells."""


# ------------------------------------------------------------------------------ one run's facts
def kind_of(cfg: dict) -> tuple[str, str, str, str]:
    """(family, kind, dose, remedy) of a run from its config mapping, e.g. ("head", "head_perturb
    redrawn every 5 steps", "controller target k3 0.01", "")."""
    mm, corr = cfg.get("mismatch") or {}, cfg.get("correction") or {}
    inj = str(mm.get("injector", "none"))
    family = FAMILY.get(inj, inj)
    if inj == "head_perturb":
        grown = mm.get("schedule", "constant") != "constant"
        every = int(mm.get("redraw_every") or 0)
        kind = "head_perturb " + ("grown" if grown else f"redrawn every {every} step{'s' * (every > 1)}" if every
                                  else "persistent")
    elif inj == "stale":
        kind = f"stale {float(mm.get('magnitude', 1)):g}"
    elif inj in ("precision", "weight_rounding"):
        kind = f"numerical {mm.get('dtype')}"
    elif inj == "fp8":
        kind = "numerical fp8"
    elif inj in ("kv_cache", "router_precision"):
        kind = f"{family} {mm.get('dtype')}"
    else:
        kind = inj.replace("_", " ")
    target, target_end = float(mm.get("target_k3") or 0), float(mm.get("target_k3_end") or 0)
    if target:
        dose = f"controller target k3 {target:g}" + (f" -> {target_end:g}" if target_end else "")
    elif inj in ("head_perturb", "logit_noise", "temperature"):
        end = float(mm.get("magnitude_end") or 0)
        dose = f"magnitude {float(mm.get('magnitude', 0)):g}" + (f" -> {end:g}" if end and kind.endswith("grown") else "")
    elif inj == "kv_cache" and float(mm.get("magnitude") or 0):
        dose = f"scale 2^{float(mm['magnitude']):g}"
    else:
        dose = ""
    remedy = "; ".join(x for x in ("router replay" if corr.get("router_replay") else "",
                                   f"{corr.get('level')} IS ({corr.get('mode')})"
                                   if corr.get("mode", "none") not in ("none", "", None) else "") if x)
    return family, kind, dose, remedy


def run_config(run: Path) -> dict:
    from timlab.experiments.studies.registration import StudyError
    from timlab.yaml_io import load_yaml

    return load_yaml((run / "config.yaml").read_text(encoding="utf-8"), str(run / "config.yaml"), StudyError) or {}


def config_params(cfg: dict) -> int:
    """The parameter count of the policy a run's config describes: its architecture (model section and
    the task's vocabulary) built on the meta device, so no weights are needed."""
    key = json.dumps({"model": {k: v for k, v in (cfg.get("model") or {}).items() if not k.startswith("pretrain")
                                and k != "path"}, "task": cfg.get("task")}, sort_keys=True)
    return _params(key)


@functools.lru_cache(maxsize=None)
def _params(key: str) -> int:
    import torch

    from timlab.config import from_dict
    from timlab.model.llama import CausalLM
    from timlab.tasks import build_task
    from timlab.tokenizer import build_char_tokenizer
    from timlab.trainer.architecture import model_config_for

    cfg = from_dict(json.loads(key))
    vocab = build_char_tokenizer(build_task(cfg).alphabet).get_vocab_size()
    with torch.device("meta"):
        model = CausalLM(model_config_for(cfg, vocab, None, cfg.model.max_position_embeddings))
    return int(sum(p.numel() for p in model.parameters()))


# ------------------------------------------------------------------------------ one cell
def _sig(x: float | None, digits: int = 6) -> float | None:
    """``x`` to ``digits`` significant digits (the record's precision), None for None or NaN."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def cell_record(*, study: str, source: str, cell: str, cfg: dict, control, arm, k3, length, persistence,
                falls, cost_window: tuple[int, int], strata=None) -> dict:
    """One cell of the record from its runs' values (each a list over runs): ``control`` and ``arm``
    the per-run cost-window means; ``k3``, ``length``, ``persistence`` the arm's per-run window means
    (NaN where a run did not log it); ``falls`` the arm's per-run falls (0/1)."""
    family, kind, dose, remedy = kind_of(cfg)
    ctrl, mine = np.asarray(control, float), np.asarray(arm, float)
    c = compare_family({"cost": ctrl}, {"cost": mine}, None if strata is None else {"cost": strata})["cost"]
    pers = np.asarray(persistence, float)
    logged = pers[np.isfinite(pers)]
    return {"study": study, "source": source, "cell": cell, "family": family, "kind": kind, "dose": dose,
            "remedy": remedy, "task": str((cfg.get("task") or {}).get("name", "")), "k3": _sig(float(np.mean(k3))), "k3_window": [FIRST_STEP, cost_window[1]],
            "length": _sig(float(np.mean(length))),
            "persistence_ema": _sig(float(np.mean(logged))) if len(logged) else None,
            "persistence_runs": int(len(logged)), "params": config_params(cfg),
            "cost": _sig(c.diff), "cost_ci": [_sig(c.diff_ci[0]), _sig(c.diff_ci[1])], "p": _sig(c.p, 4),
            "detectable": bool(c.above()), "cost_window": list(cost_window), "seeds": int(len(mine)),
            "control_seeds": int(len(ctrl)), "falls": int(np.sum(falls))}


# ------------------------------------------------------------------------------ the sources
def harm_cells(root: Path) -> list[dict]:
    """Study H's in-sample cells and the arms beside its fit, every committed seed (its cost window)."""
    from timlab.experiments.studies.endpoints import window_stat
    from timlab.experiments.studies.predictor import _window_mean, load_predictor, source_cells, source_runs
    from timlab.rundir import read_metrics

    pst = load_predictor(root / HARM)
    end = pst.cost_window[1]
    out = []
    for src in pst.sources:
        src = dataclasses.replace(src, sweep=str(root / src.sweep))
        runs = source_runs(pst, src)
        ms = {r.run: read_metrics(r.path) for r in runs}

        def mean(r, metric, window):
            return _window_mean(ms[r.run], metric, window)

        for sc in source_cells(src, runs):
            w = (FIRST_STEP, end)
            out.append(cell_record(
                study=src.name, source="Study H, in sample" if sc.fitted else "Study H, beside the fit",
                cell=sc.name, cfg=run_config(sc.arm[0].path),
                control=[mean(r, pst.cost_metric, pst.cost_window) for r in sc.control],
                arm=[mean(r, pst.cost_metric, pst.cost_window) for r in sc.arm],
                k3=[mean(r, K3, w) for r in sc.arm], length=[mean(r, LENGTH, w) for r in sc.arm],
                persistence=[mean(r, PERSISTENCE, w) for r in sc.arm],
                falls=[window_stat(ms[r.run], COST_METRIC, "fall", rule="plateau") for r in sc.arm],
                cost_window=pst.cost_window))
    return out


EXTRA = ("ev_k3", "ev_length", "ev_persistence", "ev_fell")
"""The endpoints ``study_cells`` adds to a study to read the record's descriptive values."""


def study_cells(src: StudySource, root: Path) -> list[dict]:
    """The cells of one ordinary study (``SourceStudy``): its registered cost endpoint per run, read
    by its own engine (``endpoint_values``), with the record's descriptive values added as endpoints."""
    from timlab.experiments.studies.blocks import block_dirs
    from timlab.experiments.studies.engine import BLOCK, endpoint_values, planned_runs
    from timlab.experiments.studies.registration import Endpoint, load_study

    study = load_study(root / src.file)
    cost = next(e for e in study.endpoints if e.name == src.cost)
    w = (FIRST_STEP, cost.window[1])
    extra = (Endpoint("ev_k3", K3, "level", w), Endpoint("ev_length", LENGTH, "level", w),
             Endpoint("ev_persistence", PERSISTENCE, "level", w), Endpoint("ev_fell", COST_METRIC, "fall"))
    study = dataclasses.replace(study, endpoints=(*study.endpoints, *extra))
    vals = endpoint_values(study, root=root)
    pers = endpoint_values(study, src.persistence_out, root=root) if src.persistence_out else vals
    dirs = block_dirs(study, root=root)
    first = {}
    for p in planned_runs(study):
        first.setdefault((p.group, p.arm), dirs[p.block] / p.run_id)
    out = []
    for g, col in vals.items():
        ctrl = col[study.control]
        for arm in src.arms or [a for a in col if a != study.control]:
            a = col[arm]
            out.append(cell_record(
                study=src.name, source=src.source, cell="/".join(x for x in (src.name, g, arm) if x),
                cfg=run_config(first[g, arm]), control=ctrl[src.cost], arm=a[src.cost], k3=a["ev_k3"],
                length=a["ev_length"], persistence=pers[g][arm]["ev_persistence"], falls=a["ev_fell"],
                cost_window=tuple(cost.window), strata=(ctrl[BLOCK], a[BLOCK]) if BLOCK in a else None))
    return out


def build(root: str | Path = ".") -> dict:
    """The evidence record from the committed sweeps under ``root`` (the repository root)."""
    root = Path(root)
    cells = harm_cells(root)
    for src in SOURCES:
        cells += study_cells(src, root)
    return {"about": "the lab's measured cells: what each mismatch was and what it cost (timlab.experiments.studies."
                     "evidence; python scripts/harm_evidence.py --write)",
            "cost": f"control minus arm, each run's mean {COST_METRIC} over the study's cost window; 95% bootstrap "
                    "interval over seeds; detectable: exact permutation p < 0.05 and the interval above 0",
            "cells": cells}


def text(rec: dict) -> str:
    """The record as the committed file holds it."""
    return json.dumps(rec, indent=1) + "\n"


def write(rec: dict, path: str | Path = EVIDENCE) -> Path:
    p = Path(path)
    p.write_text(text(rec), encoding="utf-8")
    return p
