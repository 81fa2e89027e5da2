"""Machine blocks of a study (``blocks``, docs/studies.md): seeds split by the kind of machine that
runs them, each block in its own sweep directory; ``timlab study run`` runs this machine's block,
the analysis checks the start per block and relabels runs within blocks (``stats.permutation_test``
with ``strata``)."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from study_sweep import write_blocks
from test_study import ARMS, SEEDS, STEPS, metrics, registration
from timlab.cli import main
from timlab.experiments.studies.stats import permutation_test, stratified_floor
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import StudyError, study_from_dict
from timlab.experiments.studies import blocks, engine
from timlab.experiments.sweeps.spec import spec_from_dict

BLOCKS = [{"name": "amd", "isa": "avx2", "seeds": [0, 1]},
          {"name": "intel", "isa": "avx2-intel", "seeds": [2, 3, 4], "out": "sweep_intel", "fingerprint": "0220b5990add"}]


def blocked(tmp_path, **over):
    return study_from_dict(registration(out="sweep", blocks=BLOCKS, **over), root=tmp_path, source="blocked.yaml")


# ------------------------------------------------------------------------------------ the test
def brute_force_p(a, b, sa, sb) -> tuple[float, int]:
    """Two-sided p over every relabeling that keeps each stratum's count of a-values."""
    a, b, sa, sb = map(np.asarray, (a, b, sa, sb))
    pooled, labels = np.concatenate([a, b]), np.concatenate([sa, sb])
    strata = [np.flatnonzero(labels == s) for s in np.unique(labels)]
    counts = [int((sa == s).sum()) for s in np.unique(labels)]
    observed, hits, total = a.mean() - b.mean(), 0, 0
    choices = [list(combinations(m, c)) for m, c in zip(strata, counts)]

    def walk(i, chosen):
        nonlocal hits, total
        if i == len(choices):
            s = pooled[chosen].sum()
            d = s / a.size - (pooled.sum() - s) / b.size
            total += 1
            hits += abs(d) >= abs(observed) - 1e-12
            return
        for c in choices[i]:
            walk(i + 1, chosen + list(c))
    walk(0, [])
    return hits / total, total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stratified_permutation_test_is_the_brute_force_one(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0, 1, 7), rng.normal(0.5, 1, 6)
    sa, sb = [0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 2, 2, 2]
    t = permutation_test(a, b, strata=(sa, sb))
    p, n = brute_force_p(a, b, sa, sb)
    assert (t.p, t.n_relabelings, t.exact) == (pytest.approx(p), n, True)
    assert n == 3 * 10 * 10 and t.floor == stratified_floor((sa, sb)) == 2 / 300
    # one stratum: the plain test, bit for bit
    assert permutation_test(a, b, strata=([0] * 7, [0] * 6)).p == permutation_test(a, b).p


def test_strata_keep_a_machine_shift_out_of_the_null():
    """3 + 5 seeds a side; block 2 sits 1.0 lower in both arms; the arm is 0.1 lower everywhere. The
    within-block test separates it as far as 8 vs 8 in those blocks can (its floor); relabeling
    across blocks lets the shift swamp it."""
    base = np.array([0.0, 0.01, -0.01, -1.0, -0.99, -1.01, -1.005, -0.995])
    ctrl, arm, s = base, base - 0.1, [0, 0, 0, 1, 1, 1, 1, 1]
    within, across = permutation_test(arm, ctrl, strata=(s, s)), permutation_test(arm, ctrl)
    assert within.p == within.floor == 2 / 5040 and within.n_relabelings == 5040
    assert across.p > 0.3


def test_strata_must_label_every_value():
    with pytest.raises(ValueError, match="one label per value"):
        permutation_test([1.0, 2.0], [3.0], strata=([0], [0]))


# ---------------------------------------------------------------------------- the registration
@pytest.mark.parametrize("blocks, words", [
    ([BLOCKS[0]], "at least two blocks"),
    ([BLOCKS[0], {**BLOCKS[1], "seeds": [1, 2]}], "seed 1 is already in block 'amd'"),
    ([BLOCKS[0], {**BLOCKS[1], "isa": "avx512"}], "valid choices: avx2, avx2-intel"),
    ([BLOCKS[0], {**BLOCKS[1], "fingerprint": "abc"}], "12 hex digits"),
    ([BLOCKS[0], {**BLOCKS[1], "seeds": []}], "non-empty list of seeds"),
    ([BLOCKS[0], {**BLOCKS[1], "name": "amd"}], "two named 'amd'"),
    ([BLOCKS[0], {**BLOCKS[1], "machine": "x"}], "unknown key 'machine'"),
])
def test_bad_blocks_are_one_line(tmp_path, blocks, words):
    with pytest.raises(StudyError, match=words) as e:
        study_from_dict(registration(blocks=blocks), root=tmp_path, source="s.yaml")
    assert "\n" not in str(e.value) and str(e.value).startswith("s.yaml: blocks")


def test_a_seed_in_no_block_is_refused(tmp_path):
    st = study_from_dict(registration(blocks=[BLOCKS[0], {**BLOCKS[1], "seeds": [2, 3]}]), root=tmp_path,
                         source="s.yaml")
    with pytest.raises(StudyError, match=r"run 'control_s4' has seed 4, in no block; the blocks' seeds: amd 0-1, "
                                         r"intel 2-3"):
        planned_runs(st)


def test_blocks_are_part_of_the_hash(tmp_path):
    plain = study_from_dict(registration(out="sweep"), root=tmp_path)
    assert blocked(tmp_path).hash != plain.hash
    moved = [BLOCKS[0], {**BLOCKS[1], "seeds": [2, 3, 4], "out": "elsewhere"}]
    assert study_from_dict(registration(out="sweep", blocks=moved), root=tmp_path).hash != blocked(tmp_path).hash


# --------------------------------------------------------------------------------- running
def test_study_run_takes_the_block_of_this_machine(tmp_path, monkeypatch):
    st = blocked(tmp_path)
    monkeypatch.setattr("timlab.machine.bits", lambda: "avx2-intel")
    monkeypatch.setattr("timlab.machine.fingerprint", lambda: "0220b5990add")
    assert blocks.machine_block(st).name == "intel"
    spec = blocks.block_spec(spec_from_dict(st.sweep, root=st.sweep_root), planned_runs(st), "intel")
    assert [c.name for c in spec.conditions] == [f"{a}_s{s}" for s in (2, 3, 4) for a in ARMS]
    monkeypatch.setattr("timlab.machine.fingerprint", lambda: "123456789abc")
    with pytest.raises(StudyError, match="fingerprint is 123456789abc, not block intel's 0220b5990add"):
        blocks.machine_block(st)
    monkeypatch.setattr("timlab.machine.bits", lambda: "AVX512")
    with pytest.raises(StudyError, match=r"no block runs on this machine \(AVX512; pin it with `timlab --isa avx2`\); "
                                         r"blocks: amd: avx2; intel: avx2-intel 0220b5990add"):
        blocks.machine_block(st)
    monkeypatch.setattr("timlab.machine.bits", lambda: "avx2")
    assert blocks.machine_block(st).name == "amd"


def test_block_spec_of_a_seed_grid(tmp_path):
    conds = [{"name": a, "set": {"mismatch.injector": "none" if a == "control" else "head_perturb"}} for a in ARMS]
    st = study_from_dict(registration(sweep={"base": {"preset": "smoke", "set": {"run.steps": STEPS}},
                                             "conditions": conds, "grid": {"run.seed": list(range(SEEDS))}},
                                      blocks=BLOCKS), root=tmp_path)
    spec = blocks.block_spec(spec_from_dict(st.sweep, root=st.sweep_root), planned_runs(st), "amd")
    assert spec.grid["run.seed"] == [0, 1] and len(spec.conditions) == 3


def test_cli_run_refuses_a_machine_of_no_block(tmp_path, monkeypatch, capsys):
    import yaml

    f = tmp_path / "blocked.yaml"
    f.write_text(yaml.safe_dump(registration(out="sweep", blocks=BLOCKS)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("timlab.machine.bits", lambda: "AVX512")
    assert main(["study", "run", str(f), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no block runs on this machine (AVX512" in err
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "sweep_intel").exists()  # nothing written
    assert main(["study", "analyze", str(f), "--out", "x"]) == 2
    assert "--out does not apply" in capsys.readouterr().err
    assert main(["study", "check", str(f)]) == 0
    out = capsys.readouterr().out
    assert "  block amd (machine avx2; seeds 0-1; 0 of 6 runs finished): sweep: not frozen yet (no run)" in out
    assert ("  block intel (machine avx2-intel, fingerprint 0220b5990add; seeds 2-4; 0 of 9 runs finished): "
            "sweep_intel: not frozen") in out


# --------------------------------------------------------------------------------- analysing
def test_analysis_reads_each_block_and_checks_its_start(tmp_path, monkeypatch):
    st = blocked(tmp_path)
    dirs = write_blocks(st, tmp_path, metrics, names=[p.name for p in planned_runs(st) if p.block == "amd"])
    assert sorted(p.name for p in dirs.values()) == ["sweep", "sweep_intel"]
    res = analyze(st, root=tmp_path)
    assert res.status == "incomplete" and "missing: control seeds 2-4, head seeds 2-4, tiny seeds 2-4" in res.text
    monkeypatch.chdir(tmp_path)
    assert engine.progress(st) == {"amd": (6, 6), "intel": (0, 9)}
    st = blocked(tmp_path / "b")
    write_blocks(st, tmp_path / "b", lambda n: metrics(n).assign(**{"val/gold_logprob": -0.4})
                 if n.endswith(("_s2", "_s3", "_s4")) else metrics(n))
    res = analyze(st, root=tmp_path / "b")
    assert res.status == "complete", res.text
    assert res.text.splitlines()[0].endswith(
        "step-0 evaluation the same in all 6 runs of block amd (accuracy 0.900, gold log-prob -0.300); step-0 "
        "evaluation the same in all 9 runs of block intel (accuracy 0.900, gold log-prob -0.400): VALID.")
    assert res.verdicts[("cost", "acc", "head")] is True
