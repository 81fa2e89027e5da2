"""Markdown tables for docs/FINDINGS.md from `timlab gradcheck --json` files and a gradcheck sweep.

Used by ``python scripts/gradcheck_tables.py docs/gradcheck_results [--sweep sweeps/gradcheck]``
(``main``), the command FINDINGS' gradcheck section names:

1. ``dose_table``: one row per ``dose_*.json``: realized mismatch, cosine, relative bias (95% CI),
   noise floor, SNR, and measured / bound;
2. ``length_tables``: one table per ``tsq_*.json``: the same per response-length bucket, and the
   fitted exponent;
3. ``sweep_table`` (``--sweep``): per condition, the in-run gradcheck metrics early (steps <= 40),
   in the 30 steps up to each run's collapse (or steps 41-100 for runs that did not collapse), and
   after.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd


def _ci(d: dict, key: str, fmt: str = ".3g") -> str:
    v, lo, hi = d[key], d.get(f"{key}_lo", math.nan), d.get(f"{key}_hi", math.nan)
    return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def dose_table(folder: Path) -> str:
    lines = ["| injector | k3 | TV max / mean | same y | cosine [95% CI] | rel. bias [95% CI] | noise floor | "
             "rel. bias, importance-weighted [95% CI] | its noise floor | SNR exact / tim | measured / bound (upper CI) |",
             "|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|"]
    for f in sorted(folder.glob("dose*.json")):
        d = json.loads(f.read_text())
        s, p, b, row = d["settings"], d["pooled"], d["bound"], d["buckets"][0]
        name = f"{s['injector']} {s['magnitude']:g}" + (f" ({s['samples']} samples)" if s["samples"] != 2048 else "")
        lines.append(
            f"| {name} ({f.stem}) | {d['mismatch']['rollout_corr/k3_kl']:.2g} | {b['delta_max']:.3g} / {b['delta_mean']:.2g} "
            f"| {row['same_response_frac']:.2f} | {_ci(p, 'cosine', '.4f')} | {_ci(p, 'rel_bias')} | {p['noise_floor_rel']:.3g} "
            f"| {_ci(p, 'rel_bias_is') if 'rel_bias_is' in p else '-'} | {p.get('noise_floor_rel_is', math.nan):.3g} "
            f"| {p['snr_exact']:.2g} / {p['snr_tim']:.2g} | {row['tightness']:.2g} ({row['tightness_hi']:.2g}) |")
    return "\n".join(lines)


def length_tables(folder: Path) -> str:
    out = []
    for f in sorted(folder.glob("tsq_*.json")):
        d = json.loads(f.read_text())
        s, b = d["settings"], d["bound"]
        out.append(f"**{f.stem}**: {s['injector']} {s['magnitude']:g}, {s['samples']} samples, dense reward "
                   f"{s['dense_reward']}, k3 {d['mismatch']['rollout_corr/k3_kl']:.3g}; Delta max {b['delta_max']:.3g} "
                   f"(mean {b['delta_mean']:.3g}), B {b['score_norm_max']:.3g} (mean token score norm "
                   f"{b['score_norm_mean']:.3g}, max sequence score norm {b['seq_score_norm_max']:.3g}); "
                   f"fitted ||bias|| ~ T^{b['bias_exponent']:.2f}\n")
        out.append("| answers | T mean / max | TV mean | same y | ||bias|| [95% CI] | noise floor | ||g_exact|| [95% CI] "
                   "| rel. bias | SNR exact / tim | 2 B Delta T^2 | measured / bound |")
        out.append("|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|")
        for r in d["buckets"]:
            out.append(f"| {r['answer_len_min']}-{r['answer_len_max']} | {r['T_mean']:.1f} / {r['T_max']} | {r['tv_mean']:.3g} "
                       f"| {r['same_response_frac']:.2f} | {_ci(r, 'bias_norm')} | {r['noise_floor_norm']:.3g} "
                       f"| {_ci(r, 'grad_norm_exact')} | {r['rel_bias']:.3g} | {r['snr_exact']:.2g} / {r['snr_tim']:.2g} "
                       f"| {r['bound']:.3g} | {r['tightness']:.2g} |")
        out.append("")
    return "\n".join(out)


def sweep_table(sweep: Path) -> str:
    idx = pd.read_parquet(sweep / "index.parquet")
    keys = ["gradcheck/rel_bias", "gradcheck/cosine_plugin", "gradcheck/snr_exact", "gradcheck/snr_tim", "rollout_corr/k3_kl"]
    rows = []
    for _, r in idx.iterrows():
        df = pd.read_parquet(sweep / r["run_dir"] / "metrics.parquet").set_index("step")
        c = r.get("steps_to_collapse", math.nan)
        pre = (lambda i: (i > c - 30) & (i <= c)) if np.isfinite(c) else (lambda i: (i > 40) & (i <= 100))
        row = {"condition": r["condition"], "collapsed": bool(np.isfinite(c)),
               "gc_s": df["time/gradcheck_s"].mean(), "step_s": df["train/step_time_s"].mean()}
        for k in keys:
            s = df[k].dropna()
            short = k.split("/")[1]
            row[f"{short} early"] = s[s.index <= 40].mean()
            row[f"{short} pre"] = s[pre(s.index)].mean()
        rows.append(row)
    t = pd.DataFrame(rows)
    g = t.groupby("condition", sort=False).agg({**{c: "mean" for c in t.columns if c not in ("condition", "collapsed")},
                                                "collapsed": "sum"})
    return g.to_markdown(floatfmt=".3g")


def main(argv: list[str] | None = None) -> None:
    """``python scripts/gradcheck_tables.py FOLDER [--sweep SWEEP]``: the tables, printed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--sweep", type=Path)
    a = ap.parse_args(argv)
    print(dose_table(a.folder), "\n")
    print(length_tables(a.folder))
    if a.sweep:
        print(sweep_table(a.sweep))
