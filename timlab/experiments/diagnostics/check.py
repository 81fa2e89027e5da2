"""``timlab check``: the model-onboarding matrix, with verdicts and a CI gate.

NeMo-RL's model-onboarding procedure checks that the training and generation back-ends agree,
measured as mean exp(|log pi - log mu|) below 1.05, across batch sizes, sequence lengths and
greedy vs sampled decoding; slime's CI asserts the train/rollout log-prob difference below 1e-6.
``run_check`` runs that matrix on any engine pair of ``timlab probe`` (it reuses the probe's
loading, rollout and scoring: ``timlab.experiments.diagnostics.probe.probe_prompts``):

    batch sizes (default 1, 8, 32)  x  lengths (short, long: prompt and answer tokens)
                                    x  decoding (greedy: temperature 0; sampling: temperature 1)

Each cell rolls out ``batch`` random prompts together (token ids drawn from the tokenizer's
non-special ids, lengths uniform in [P/2, P], seeded per cell) for up to A new tokens, rescores them
and reports mean exp(|r|), mean and max |r|, k3, the bitwise-equal fraction and more
(``CELL_KEYS``), and a verdict against ``HEALTH_CHECKS``: the field's 1.05 for mean exp(|r|) and
verl's health checks (|kl| <= 0.1, chi2_token <= 1, ESS >= 0.3, from verl's rollout-correction
docs). With ``fail_above`` the gate fails when any cell's ``gate_metric`` (default mean |r|)
exceeds it: ``timlab check --fail-above 0`` demands bitwise-equal log-probs, as a CI job would.
The noise-vs-bias length diagnostic (``timlab.metrics.length_scaling``) runs on all cells pooled.

A folder without a tokenizer (a random model written by transformers) is checked too: the prompts
are random token ids anyway, so the special ids come from its config.json, and the result says so
(``notes``). The default lengths are clipped to the model's context (with a note); lengths the
user gives are not, and one that does not fit is a one-line error.

Not from a paper: a diagnostic in the spirit of NeMo-RL's onboarding checks.
"""

from __future__ import annotations

import html
import math
import random
from dataclasses import dataclass
from pathlib import Path

from timlab.config import SEED_RANGE
from timlab.engines import SamplingParams
from timlab.engines.device_loop import loop_for
from timlab.errors import UsageError
from timlab.experiments.diagnostics.probe import _check_names, _check_vocab, probe_prompts
from timlab.metrics import (
                            format_length_scaling,
                            length_scaling_from_sums,
                            length_scaling_sums,
                            merge_length_scaling_sums,
                            mismatch_metrics,
                            offpolicy_metrics,
                            )

DEFAULT_BATCH_SIZES = "1,8,32"
DEFAULT_LENGTHS = "short=16:32,long=128:256"
"""name=P:A, comma-separated: prompts of up to P tokens, answers of up to A new tokens."""
DEFAULT_DECODING = "greedy,sampling"
MAX_BATCH_SIZE = 4096
"""Largest ``--batch-sizes`` entry: a typo such as 99999999 is refused before any work."""
MAX_BOOT = 10_000
"""Most bootstrap resamples (``--boot``): the resampling holds resamples x sequences float64 numbers."""
DECODING = {"greedy": SamplingParams(temperature=0.0), "sampling": SamplingParams(temperature=1.0)}
"""Decoding modes by name."""


@dataclass(frozen=True)
class HealthCheck:
    """One documented threshold a cell must meet."""

    metric: str
    """A key of the cell (``CELL_KEYS``)."""
    op: str
    """"<=" or ">=": how the value must compare with the limit to pass."""
    limit: float
    source: str
    """Where the threshold comes from."""

    def passes(self, value: float) -> bool:
        return value <= self.limit if self.op == "<=" else value >= self.limit


HEALTH_CHECKS = (
    HealthCheck("exp_abs_diff_mean", "<=", 1.05, "NeMo-RL model onboarding: mean exp(|r|) < 1.05"),
    HealthCheck("abs_kl", "<=", 0.1, "verl rollout-correction health check: |kl| > 0.1 warns"),
    HealthCheck("chi2_token", "<=", 1.0, "verl: chi2_token > 1 warns"),
    HealthCheck("ess", ">=", 0.3, "verl: ESS < 0.3 warns"),
)

CELL_KEYS = ("num_tokens", "mean_response_length", "exp_abs_diff_mean", "mean_abs_diff", "max_abs_diff", "k3_kl",
             "kl", "abs_kl", "chi2_token", "ess", "frac_bitwise_equal", "frac_tokens_different", "log_ppl_abs_diff",
             "probs_diff_mean")
"""Numbers reported per cell (timlab.metrics' definitions; ``abs_kl`` = |rollout_corr/kl|)."""

GATE_METRICS = ("mean_abs_diff", "max_abs_diff", "exp_abs_diff_mean", "k3_kl", "abs_kl", "chi2_token",
                "log_ppl_abs_diff", "probs_diff_mean", "frac_tokens_different")
"""Cell numbers the gate can use (larger is worse for each)."""


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise UsageError(f"--batch-sizes {text!r}: expected comma-separated integers >= 1, e.g. {DEFAULT_BATCH_SIZES}")
    if max(sizes) > MAX_BATCH_SIZE:
        raise UsageError(f"--batch-sizes {text!r}: {max(sizes)} is more than {MAX_BATCH_SIZE} sequences per batch")
    return sizes


def parse_lengths(text: str) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            name, spec = part.split("=")
            p, a = (int(x) for x in spec.split(":"))
        except ValueError:
            raise UsageError(f"--lengths {text!r}: expected name=PROMPT:ANSWER entries, e.g. {DEFAULT_LENGTHS}") from None
        if p < 1 or a < 1 or not name.strip():
            raise UsageError(f"--lengths {text!r}: prompt and answer lengths must be >= 1 and named")
        if name.strip() in out:
            raise UsageError(f"--lengths {text!r}: the name {name.strip()!r} is given twice; each entry needs its own")
        out[name.strip()] = (p, a)
    if not out:
        raise UsageError(f"--lengths {text!r}: expected name=PROMPT:ANSWER entries, e.g. {DEFAULT_LENGTHS}")
    return out


def parse_decoding(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in DECODING]
    if not names or bad:
        raise UsageError(f"--decoding {text!r}: unknown mode {bad[0] if bad else ''!r}; valid choices: {', '.join(DECODING)}")
    return names


@dataclass(frozen=True)
class ConfigIds:
    """The little of a tokenizer that ``run_check`` uses (the special ids), read from the model's
    config.json: a stand-in for a folder that has no tokenizer, since the prompts are random ids."""

    eos_token_id: int
    pad_token_id: int | None
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: tuple[int, ...] = ()


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds tokenizer files (tokenizer.json, or those transformers reads)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    return any((Path(model_dir) / n).is_file() for n in names)


def load_check_model(model_dir: str | Path, *, dtype: str, device: str) -> tuple[object, object, list[str]]:
    """The model, its tokenizer (or ``ConfigIds`` when the folder has none) and notes for the user."""
    from timlab.model.hf_io import load_model
    from timlab.tokenizer import load_tokenizer

    model = load_model(model_dir, dtype=dtype, device=device)
    if not has_tokenizer(model_dir):
        c = model.config
        if c.eos_token_id is None:
            raise UsageError(f"{str(model_dir)!r} has no tokenizer and its config.json names no eos_token_id; "
                             "add a tokenizer (tokenizer.json) or eos_token_id")
        ids = ConfigIds(eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
                        vocab_size=c.vocab_size)
        return model, ids, [f"no tokenizer in {model_dir}: prompts are random ids among the model's "
                            f"{c.vocab_size} tokens, special ids (eos {c.eos_token_id}, pad {c.pad_token_id}, "
                            f"bos {c.bos_token_id}) from its config.json"]
    tokenizer = load_tokenizer(model_dir)
    _check_vocab(tokenizer, model)
    return model, tokenizer, []


def fit_lengths(lens: dict[str, tuple[int, int]], context: int, *, clip: bool) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """``lens`` checked against the model's context. With ``clip`` (the default lengths) an entry
    that needs more positions than ``context`` is scaled down to fill it, keeping its
    prompt:answer ratio, and a note says so; without, it is a one-line error."""
    out, notes = {}, []
    for name, (p, a) in lens.items():
        if p + a <= context:
            out[name] = (p, a)
            continue
        if not clip or context < 2:
            raise UsageError(f"--lengths {name}={p}:{a} needs {p + a} positions, more than the model's context "
                             f"(max_position_embeddings={context})")
        p2 = max(1, min(context - 1, p * context // (p + a)))
        out[name] = (p2, context - p2)
        notes.append(f"default length {name}={p}:{a} clipped to {name}={p2}:{context - p2} to fit the model's "
                     f"context of {context} positions")
    return out, notes


def _prompts(tokenizer, vocab: int, batch: int, max_len: int, seed: int) -> list[list[int]]:
    """``batch`` random prompts of non-special token ids, lengths uniform in [ceil(P/2), P]."""
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | {
        tokenizer.eos_token_id, tokenizer.pad_token_id, getattr(tokenizer, "bos_token_id", None)}
    ids = [i for i in range(vocab) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(rng.randint(max(1, (max_len + 1) // 2), max_len))] for _ in range(batch)]


def _cell_metrics(out) -> dict:
    r = out.rollout
    mm = mismatch_metrics(out.score_logp, r.logprobs, r.response_mask)
    off = offpolicy_metrics(out.score_logp, r.logprobs, r.response_mask)
    return {
        "num_tokens": int(mm["num_tokens"]),
        "mean_response_length": out.summary["mean_response_length"],
        "exp_abs_diff_mean": mm["exp_abs_diff_mean"],
        "mean_abs_diff": mm["abs_diff_mean"],
        "max_abs_diff": mm["max_abs_diff"],
        "k3_kl": off["k3_kl"],
        "kl": off["kl"],
        "abs_kl": abs(off["kl"]),
        "chi2_token": off["chi2_token"],
        "ess": mm["ess"],
        "frac_bitwise_equal": mm["frac_bitwise_equal"],
        "frac_tokens_different": mm["frac_tokens_different"],
        "log_ppl_abs_diff": off["log_ppl_abs_diff"],
        "probs_diff_mean": mm["probs_diff_mean"],
    }


MIN_TOKENS = 16
"""A cell with fewer valid tokens gets no "pass": its means say too little to pass a health check
("too few tokens"); a failed check still fails, and bitwise equality is still stated."""


def verdict(cell: dict) -> tuple[str, list[str]]:
    """("bitwise" | "pass" | "too few tokens" | "FAIL", the failed checks as 'metric value op limit')."""
    failed = [f"{h.metric} {cell[h.metric]:.4g} {'>' if h.op == '<=' else '<'} {h.limit:g}"
              for h in HEALTH_CHECKS if not h.passes(cell[h.metric])]
    if failed:
        return "FAIL", failed
    if cell["frac_bitwise_equal"] == 1.0:
        return "bitwise", []
    return ("pass" if cell["num_tokens"] >= MIN_TOKENS else "too few tokens"), []


def run_check(
    *,
    model_dir: str | Path,
    rollout: str = "fast",
    score: str = "trainer",
    dtype: str = "float32",
    device: str = "cpu",
    batch_sizes: str = DEFAULT_BATCH_SIZES,
    lengths: str = DEFAULT_LENGTHS,
    decoding: str = DEFAULT_DECODING,
    seed: int = 0,
    fail_above: float | None = None,
    gate_metric: str = "mean_abs_diff",
    n_boot: int = 200,
    decode_loop: str = "host",
    progress=None,
) -> dict:
    """Run the matrix; return a JSON-ready dict: settings, ``cells`` (one dict per cell with
    ``CELL_KEYS``, ``verdict`` and ``failed_checks``), ``health_checks``, ``gate`` and
    ``length_scaling``. ``decode_loop``: the rollout engine's decode loop, host, device or graphs
    (``timlab.engines.device_loop``; graphs are CUDA graphs on a GPU). ``progress(phase, i, n,
    metrics)`` is called after each cell."""
    _check_names(rollout, score, attribute=False)
    loop = loop_for(decode_loop, engine=rollout, names=("--decode-loop", "--rollout"))
    sizes, lens, modes = parse_batch_sizes(batch_sizes), parse_lengths(lengths), parse_decoding(decoding)
    if gate_metric not in GATE_METRICS:
        raise UsageError(f"unknown --gate-metric {gate_metric!r}; valid choices: {', '.join(GATE_METRICS)}")
    if fail_above is not None and not (math.isfinite(fail_above) and fail_above >= 0):
        raise UsageError(f"--fail-above must be a finite number >= 0, got {fail_above}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise UsageError(f"--seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {str(seed)[:40]}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or not 1 <= n_boot <= MAX_BOOT:
        raise UsageError(f"--boot must be an integer in [1, {MAX_BOOT}], got {str(n_boot)[:40]}")
    model, tokenizer, notes = load_check_model(model_dir, dtype=dtype, device=device)
    lens, clipped = fit_lengths(lens, model.config.max_position_embeddings, clip=lengths == DEFAULT_LENGTHS)
    notes += clipped
    vocab = min(tokenizer.vocab_size, model.config.vocab_size)

    cells, sums = [], None
    grid = [(b, name, mode) for b in sizes for name in lens for mode in modes]
    for i, (b, name, mode) in enumerate(grid):
        p, a = lens[name]
        cell_seed = seed * 1_000_003 + i
        out = probe_prompts(model, tokenizer, _prompts(tokenizer, vocab, b, p, cell_seed), rollout=rollout, score=score,
                            sampling=DECODING[mode], max_new_tokens=a, seed=cell_seed, loop=loop)
        cell = {"batch": b, "length": name, "prompt_tokens": p, "answer_tokens": a, "decoding": mode,
                **_cell_metrics(out)}
        cell["verdict"], cell["failed_checks"] = verdict(cell)
        cells.append(cell)
        s = length_scaling_sums(out.score_logp, out.rollout.logprobs, out.rollout.response_mask)
        sums = s if sums is None else merge_length_scaling_sums(sums, s)
        if progress is not None:
            progress("check", i + 1, len(grid), {})

    over = [c for c in cells if fail_above is not None and c[gate_metric] > fail_above]
    return {
        "model_dir": str(model_dir), "num_params": sum(p.numel() for p in model.parameters()),
        "rollout": rollout, "decode_loop": decode_loop, "score": score, "dtype": dtype, "device": device,
        "seed": seed, "batch_sizes": sizes, "lengths": {k: list(v) for k, v in lens.items()}, "decoding": modes,
        "notes": notes, "cells": cells,
        "health_checks": [{"metric": h.metric, "op": h.op, "limit": h.limit, "source": h.source} for h in HEALTH_CHECKS],
        "healthy": all(c["verdict"] != "FAIL" for c in cells),
        "gate": {"metric": gate_metric, "fail_above": fail_above, "failed": bool(over),
                 "failed_cells": [f"batch {c['batch']} {c['length']} {c['decoding']}" for c in over],
                 "worst": max(c[gate_metric] for c in cells)},
        "length_scaling": length_scaling_from_sums(sums, n_boot=n_boot, seed=seed),
    }


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def cell_text(key: str, x: float) -> str:
    """A cell's number as the terminal table prints it: mean e^|r| to 4 decimals (1.0006 is not "1"),
    fractions as percents, the rest to 3 significant digits."""
    if key == "exp_abs_diff_mean":
        return f"{x:.4f}"
    if key.startswith("frac_"):
        return f"{100 * x:.1f}%"
    return _fmt(x)


def format_check(result: dict) -> str:
    """The matrix as a text table, then the health, the gate and the length reading."""
    cols = ("batch", "length", "decoding", "num_tokens", "exp_abs_diff_mean", "mean_abs_diff", "max_abs_diff", "k3_kl",
            "frac_bitwise_equal", "verdict")
    heads = ("batch", "length", "decoding", "tokens", "mean e^|r|", "mean |r|", "max |r|", "k3", "bitwise", "verdict")
    rows = [[str(c[k]) if not isinstance(c[k], float) else cell_text(k, c[k]) for k in cols] for c in result["cells"]]
    for row, c in zip(rows, result["cells"]):
        if c["failed_checks"]:
            row[9] += " (" + "; ".join(c["failed_checks"]) + ")"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(x.rjust(w) if i not in (1, 2, 9) else x.ljust(w)  # noqa: E731
                                   for i, (x, w) in enumerate(zip(cells, widths)))
    loop = result.get("decode_loop", "host")
    out = [f"check: rollout={result['rollout']}{'' if loop == 'host' else f' decode_loop={loop}'} "
           f"score={result['score']} dtype={result['dtype']} model={result['model_dir']}", *(f"note: {n}" for n in result.get("notes", ())),
           line(heads), *(line(r) for r in rows)]
    checks = ", ".join(f"{h['metric']} {h['op']} {h['limit']:g}" for h in result["health_checks"])
    out.append(f"health ({checks}): {'all cells pass' if result['healthy'] else 'FAILED in some cells'}")
    g = result["gate"]
    if g["fail_above"] is not None:
        state = "FAILED: " + ", ".join(g["failed_cells"]) if g["failed"] else "passed"
        out.append(f"gate {g['metric']} <= {g['fail_above']:g} (worst {_fmt(g['worst'])}): {state}")
    out.append("length scaling: " + format_length_scaling(result["length_scaling"]))
    out.append(harm_prediction_line(result))
    return "\n".join(out)


def harm_prediction_line(result: dict) -> str:
    """The answer to "is this mismatch a problem?" (``timlab.experiments.diagnostics.harm_prediction``) at the largest
    k3 of the matrix: its cell's answer tokens, the model's size, the kind where ``--kind`` stated it."""
    from timlab.experiments.diagnostics.harm_prediction import harm_answer

    worst = max(result["cells"], key=lambda c: c["k3_kl"])
    metrics = {"rollout_corr/k3_kl": worst["k3_kl"], "mismatch/max_abs_diff": worst["max_abs_diff"]}
    return (harm_answer(metrics, length=worst["answer_tokens"],
                        params=result.get("num_params"), kind=result.get("mismatch_kind"))
            + f"\n  (from cell {worst['batch']}/{worst['length']}/{worst['decoding']}, the largest k3 of the matrix)")


def write_check_html(result: dict, path: str | Path) -> Path:
    """One self-contained page: the matrix (failing cells in red), the thresholds, the gate and
    the length-scaling curve (log-log, with T^0.5 and T^1 guides)."""
    from timlab.experiments.reports.page import new_figure, png_uri

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    e = html.escape
    title = f"timlab check: rollout {result['rollout']} vs score {result['score']} ({result['dtype']})"
    keys = ("batch", "length", "decoding", "verdict", *CELL_KEYS)  # the verdict beside the cell it judges
    head = "".join(f"<th>{e(k)}</th>" for k in keys)
    body = ""
    for c in result["cells"]:
        color = {"FAIL": "#fdd", "bitwise": "#dfd", "too few tokens": "#eee"}.get(c["verdict"], "#fff")
        tds = "".join(f"<td>{cell_text(k, c[k]) if isinstance(c[k], float) else e(str(c[k]))}</td>" for k in keys)
        note = f" title='{e('; '.join(c['failed_checks']))}'" if c["failed_checks"] else ""
        body += f"<tr style='background:{color}'{note}>{tds}</tr>"
    checks = "".join(f"<li><code>{e(h['metric'])} {e(h['op'])} {h['limit']:g}</code>: {e(h['source'])}</li>"
                     for h in result["health_checks"])
    g = result["gate"]
    gate = ("no gate (--fail-above not given)" if g["fail_above"] is None else
            f"{e(g['metric'])} &le; {g['fail_above']:g}: <b>{'FAILED' if g['failed'] else 'passed'}</b> "
            f"(worst cell {_fmt(g['worst'])})")
    ls = result["length_scaling"]
    notes = "".join(f"<p>Note: {e(n)}.</p>" for n in result.get("notes", ()))
    parts = [f"<h1>{e(title)}</h1>", f"<p>Model <code>{e(result['model_dir'])}</code>, seed {result['seed']}.</p>", notes,
             f"<div style='overflow-x:auto'><table><tr>{head}</tr>{body}</table></div>", f"<h2>Thresholds</h2><ul>{checks}</ul>", f"<h2>Gate</h2><p>{gate}</p>",
             f"<h2>Noise or bias?</h2><p>{e(format_length_scaling(ls))}</p>",
             f"<h2>Is this mismatch a problem?</h2><pre>{e(harm_prediction_line(result))}</pre>"]
    if len(ls["lengths"]) >= 2 and any(v > 0 for v in ls["rms_sum"]):
        fig = new_figure(6, 3.6)
        ax = fig.add_subplot(1, 1, 1)
        t = ls["lengths"]
        for key, label in (("rms_sum", "RMS of sum_t r"), ("mean_abs_sum", "mean of sum_t |r|")):
            ys = [max(y, 1e-300) for y in ls[key]]
            ax.loglog(t, ys, "o-", label=label)
        y0 = max(ls["rms_sum"][0], 1e-300)
        ax.loglog(t, [y0 * x ** 0.5 for x in t], ":", color="gray", label="T^0.5 (noise)")
        ax.loglog(t, [y0 * x for x in t], "--", color="gray", label="T^1 (bias)")
        ax.set_xlabel("prefix length T (tokens)")
        ax.legend(fontsize=8)
        parts.append(f"<img alt='length scaling' src='{png_uri(fig)}'>")
    style = ("body{font-family:sans-serif;max-width:1300px;margin:2em auto}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}")
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{style}</style>"
                    f"</head><body>{''.join(parts)}</body></html>")
    return path
