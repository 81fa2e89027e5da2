"""``timlab gradcheck`` from a config, a run directory or a model folder; console summary and plot.

The estimator itself lives in ``timlab.gradcheck.estimator`` (the trainer also calls it every
``run.gradcheck_every`` steps, ``timlab.gradcheck.in_run``); this module resolves what to check (the config's warm start, a
run's checkpoint, any HF folder), checks that it matches the config, and formats the result.
See docs/gradcheck.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from timlab.errors import UsageError
from timlab.gradcheck.estimator import GradcheckResult, gradcheck
from timlab.progress import Progress

# ------------------------------------------------------------------------------------ output
BUCKET_NA = {
    "rel_bias": "rel bias: the bucket's noise-corrected ||g_exact||^2 came out <= 0 (its noise exceeds its "
                "gradient); draw more samples per bucket",
    "cosine": "cosine: the bucket's g_exact or g_tim is not resolved (the interval of its norm reaches 0); "
              "draw more samples per bucket",
    "snr_exact": "SNR: a bucket's gradients did not vary between micro-batches",
    "snr_tim": "SNR: a bucket's gradients did not vary between micro-batches",
    "bias_norm": "||bias||: not computed for this bucket",
    "bound": "2BΔT², ratio: the T^2 bound is not evaluated (see the notes)",
    "tightness": "2BΔT², ratio: the T^2 bound is not evaluated (see the notes)",
}
"""Why a length bucket's column reads n/a (the value is NaN), printed under the bucket table."""


def _plugin_cosine_note(p: dict) -> str:
    """What the plain cosine beside the noise-corrected one is, and why it may lie below that
    interval: sampling noise in the two mean gradients pulls it toward 0."""
    note = "the plain cosine of the mean gradients: noise pulls it toward 0"
    if p["cosine_plugin"] < p["cosine_lo"]:  # False for a NaN interval
        note += "; here below the noise-corrected interval, which removes that pull"
    return f"({note})"


def format_gradcheck(res: GradcheckResult) -> str:
    """A console summary: settings, pooled statistics, the per-bucket table and the bound."""
    s, p, b = res.settings, res.pooled, res.bound

    def ci(key: str, d: dict, fmt: str = ".3g") -> str:
        if d[key] != d[key]:
            return "n/a (a gradient is not resolved)" if key == "cosine" else "n/a"
        return f"{d[key]:{fmt}} [{d[key + '_lo']:{fmt}}, {d[key + '_hi']:{fmt}}]"

    flag = "  [g_exact not resolved: noise]" if not p["grad_norm_exact_lo"] > 0 else ""
    clamped = "  (noise-corrected; its estimate passed 1 and is clamped)" if abs(p["cosine"]) == 1.0 else \
        "  (noise-corrected)" if p["cosine"] == p["cosine"] else ""
    lines = [
        f"gradcheck: injector {s['injector']} (magnitude {s['magnitude']:g}), estimator {s['estimator']}, "
        f"{s['samples']} samples in {s['micro_batches']} micro-batches of {s['micro_batch']}, {s['params']:,} parameters",
        f"mismatch on mu's samples: k3 {res.mismatch.get('rollout_corr/k3_kl', float('nan')):.3g}, "
        f"max |log pi - log mu| {res.mismatch.get('mismatch/max_abs_diff', float('nan')):.3g}, "
        f"per-token TV max {b['delta_max']:.3g} / mean {b['delta_mean']:.3g}",
        f"cosine(g_tim, g_exact)      {ci('cosine', p, '.4f')}{clamped}{flag}",
        f"  plug-in                   {p['cosine_plugin']:.4f}  {_plugin_cosine_note(p)}",
        f"relative bias               {ci('rel_bias', p)}  (plug-in {p['rel_bias_plugin']:.3g}, noise floor "
        f"{p['noise_floor_rel']:.3g}){flag}",
        f"||g_tim - g_exact||         {ci('bias_norm', p)}",
        *([f"  importance-weighted       {ci('rel_bias_is', p)} relative, {ci('bias_norm_is', p)} absolute "
           f"(mu's samples only; noise floor {p['noise_floor_rel_is']:.3g}; ESS of pi/mu "
           f"{p.get('is_ess_frac', float('nan')):.0%})"] if "rel_bias_is" in p else []),
        f"||g_exact||                 {ci('grad_norm_exact', p)}",
        f"SNR per sequence: exact     {ci('snr_exact', p)}",
        f"                  mismatch  {ci('snr_tim', p)}",
        "",
        f"{'T range':>9} {'T_mean':>7} {'T_max':>5} {'TV max':>8} {'same y':>6} {'rel bias':>9} {'cosine':>7} {'SNR ex':>8} "
        f"{'SNR tim':>8} {'||bias||':>9} {'2BΔT²':>9} {'ratio':>8}",
    ]
    unavailable: dict[str, None] = {}

    def cell(r: dict, key: str, width: int, fmt: str) -> str:
        if r[key] == r[key]:
            return f"{r[key]:>{width}{fmt}}"
        unavailable[BUCKET_NA[key]] = None
        return f"{'n/a':>{width}}"

    for r in res.buckets:
        lines.append(
            f"{r['answer_len_min']:>4}-{r['answer_len_max']:<4} {r['T_mean']:>7.1f} {r['T_max']:>5d} {r['tv_max']:>8.3g} {r['same_response_frac']:>6.2f} "
            f"{cell(r, 'rel_bias', 9, '.3g')} {cell(r, 'cosine', 7, '.4f')} {cell(r, 'snr_exact', 8, '.3g')} "
            f"{cell(r, 'snr_tim', 8, '.3g')} {cell(r, 'bias_norm', 9, '.3g')} {cell(r, 'bound', 9, '.3g')} "
            f"{cell(r, 'tightness', 8, '.2g')}")
    lines += [f"n/a: {why}" for why in unavailable]
    if b["applies"]:
        lines.append(
            f"bound: B (max token score norm over {b['score_tokens']} tokens) {b['score_norm_max']:.3g}, Delta {b['delta_max']:.3g}"
            f" -> C = 2 B Delta = {b['C']:.3g}; measured/bound <= {max(r['tightness_hi'] for r in res.buckets):.2g} "
            f"(upper CI); holds: {b['holds']}"
            + (f"; ||bias|| ~ T^{b['bias_exponent']:.2f}" if b["bias_exponent"] == b["bias_exponent"] else ""))
    c = res.cost
    lines.append(f"cost: {c['total_s']:.1f}s (rollouts {c['rollout_s']:.1f}s, gradients {c['gradient_s']:.1f}s, "
                 f"score norms {c['score_norm_s']:.1f}s), {c['vector_bytes'] / 2**20:.0f} MiB of gradient vectors")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def plot_gradcheck(res: GradcheckResult, path: str | Path) -> Path:
    """PNG: measured ||bias|| (with CI) and 2 B Delta T^2 against T; relative bias, cosine and SNR against T."""
    from timlab.experiments.reports.page import new_figure

    rows = sorted(res.buckets, key=lambda r: r["T_max"])
    T = [r["T_max"] for r in rows]
    fig = new_figure(11, 4)  # no pyplot: the caller's global backend is left alone
    a1, a2 = fig.subplots(1, 2)
    bias = [r["bias_norm"] for r in rows]
    err = [[max(r["bias_norm"] - r["bias_norm_lo"], 0) for r in rows], [max(r["bias_norm_hi"] - r["bias_norm"], 0) for r in rows]]
    a1.errorbar(T, bias, yerr=err, fmt="o-", color="C3", capsize=3, label="measured ||g_tim - g_exact||")
    a1.plot(T, [r["noise_floor_norm"] for r in rows], ":", color="0.5", label="noise floor (zero bias would show this)")
    if res.bound["applies"]:
        grid = torch.linspace(max(min(T), 1), max(max(T), 2), 50).tolist()
        a1.plot(grid, [res.bound["C"] * t * t for t in grid], "-", color="C0", label="2 B Δ T² (Theorem 3.1)")
    a1.set_yscale("log")
    a1.set_xscale("log")
    a1.set_xlabel("T (longest response in bucket, log scale)")
    a1.set_ylabel("gradient bias (L2)")
    a1.set_title("gradient bias vs the T² bound")
    a1.legend(fontsize=8)
    rows = sorted(res.buckets, key=lambda r: r["T_mean"])
    T = [r["T_mean"] for r in rows]
    ok = [r["grad_norm_exact_lo"] > 0 for r in rows]  # relative quantities need a resolved g_exact
    a2.plot(T, [r["rel_bias"] if k else float("nan") for r, k in zip(rows, ok)], "o-", color="C3",
            label="relative bias" + ("" if all(ok) else " (buckets with unresolved g_exact left out)"))
    a2.plot(T, [1 - r["cosine"] if k else float("nan") for r, k in zip(rows, ok)], "s--", color="C2", label="1 - cosine")
    a2b = a2.twinx()
    a2b.plot(T, [r["snr_exact"] for r in rows], "^-", color="C0", label="SNR (exact)")
    a2b.plot(T, [r["snr_tim"] for r in rows], "v--", color="C1", label="SNR (mismatch)")
    a2.set_xlabel("mean response length in bucket")
    a2.set_ylabel("relative bias, 1 - cosine")
    a2b.set_ylabel("SNR per sequence")
    h1, l1 = a2.get_legend_handles_labels()
    h2, l2 = a2b.get_legend_handles_labels()
    a2.legend(h1 + h2, l1 + l2, fontsize=8)
    a2.set_title("bias and gradient noise vs response length")
    fig.suptitle(f"gradcheck: {res.settings['injector']} (magnitude {res.settings['magnitude']:g}), "
                 f"{res.settings['samples']} samples, {res.settings['estimator']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------------ from a config / run
MODEL_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size", "model_type": "model_type"}
"""Config ``model`` keys -> the HF config.json keys a checkpoint must agree on."""

POOL_SIZE = 4096
"""Prompts drawn from the task's training split (its first ones) to sample gradcheck prompts from."""


def check_model_matches(model_dir: Path, cfg) -> None:
    """A checkpoint must have the architecture the config describes (one-line error otherwise)."""
    import json

    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{model_dir}: unreadable config.json ({e})") from None
    if cfg.model.path:
        try:
            ref = json.loads((Path(cfg.model.path) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return  # the config's own model folder is gone: nothing to compare with
        pairs = [(k, hf.get(k), ref.get(k)) for k in MODEL_KEYS.values()]
    else:
        pairs = [(hk, hf.get(hk), getattr(cfg.model, ck)) for ck, hk in MODEL_KEYS.items()]
    bad = [(k, a, b) for k, a, b in pairs if b is not None and a != b]
    if bad:
        k, a, b = bad[0]
        raise UsageError(f"checkpoint {model_dir} does not match the model config: {k} is {a!r} in the checkpoint "
                         f"but {b!r} in the config")


def run_gradcheck(cfg, *, model_dir: str | Path | None = None, group_size: int | None = None,
                  dense_reward: bool | None = None, progress: Progress | None = None, **options) -> GradcheckResult:
    """gradcheck at ``model_dir`` (a checkpoint or any HF folder; default: the config's warm start),
    with the config's task, sampling, trainer precision and mismatch injector. ``group_size`` and
    ``dense_reward`` default to the config's; ``options`` (samples, micro_batch, buckets,
    estimator, seed, n_boot, score_seqs, param_filter, ...) go to ``gradcheck``, whose defaults apply."""
    from timlab.config import SEED_RANGE, rollout_sampling, validate
    from timlab.injectors import build_injector, parse_parts
    from timlab.tasks import make_splits
    from timlab.trainer.precision import load_policy
    from timlab.trainer.pretrain import ensure_warm_start

    seed = options.get("seed", SEED_RANGE[0])
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:  # torch's manual_seed would overflow with a traceback
        raise UsageError(f"--seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {str(seed)[:40]}")
    task = validate(cfg)
    parse_parts(cfg.mismatch.injector)  # an unknown injector fails before any model is loaded
    pool, _ = make_splits(task, seed=cfg.task.split_seed, n_train=min(cfg.task.n_train, POOL_SIZE), n_val=cfg.task.n_val)
    if model_dir is None:
        model_dir = ensure_warm_start(cfg, progress=(lambda s, n, m: progress("pretrain", s, n, m)) if progress else None).path
    else:
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist")
        check_model_matches(Path(model_dir), cfg)
    tok, precision = load_policy(model_dir, cfg, device=cfg.run.device)
    model = precision.compute
    injector = build_injector(cfg.mismatch, model, default_engine=cfg.rollout.engine, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, tokenizer=tok)
    res = gradcheck(
        model, tok, task, pool, injector, group_size=group_size or cfg.rollout.samples_per_prompt,
        max_new_tokens=cfg.rollout.max_new_tokens, sampling=rollout_sampling(cfg),
        dense_reward=cfg.task.dense_reward if dense_reward is None else dense_reward, progress=progress, **options,
    )
    res.settings.update({"model": str(model_dir), "task": cfg.task.name, "dtype": cfg.model.dtype,
                         "rollout_engine": cfg.rollout.engine})
    return res
