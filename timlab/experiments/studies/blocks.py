"""Where a study's runs live, and which of them a machine may make: the sweep directory, or one per
machine block (``Study.blocks``, docs/studies.md "Machine blocks").

A pinned run repeats bit for bit only on machines of the same fingerprint, so a study whose seeds
must run on two kinds of machine splits them into blocks, each run whole on one kind, in its own
directory. Here: the block of a run (``block_of``), each block's directory (``block_dirs``), the
block of this machine and its part of the sweep spec (``machine_block``, ``block_spec``, for
``timlab study run``), the runs' states read from their own block's directory (``study_states``)
and the freeze checked in each (``check_freezes``). The analysis relabels within blocks
(``engine``, ``stats.permutation_test``'s ``strata``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pandas as pd

from timlab.experiments.studies.registration import Block, Study, StudyError, check_freeze, holds_runs
from timlab.experiments.studies.sweep_runs import PlannedRun, seed_ranges

SEED = "run.seed"
"""The sweep grid key of a run's seed (a seeded grid names its runs ``<condition>_s<seed>``)."""


def sweep_dir(study: Study, out: str | Path | None = None) -> Path:
    """The study's sweep directory: ``out``, else the file's ``out``."""
    d = out or study.out
    if not d:
        raise StudyError(f"{study.source}: no sweep directory: set out: in the study file or pass --out")
    return Path(d)


def block_of(study: Study, name: str) -> str:
    """The block (``Study.blocks``) whose seeds hold the run named ``name`` (``<arm>_s<seed>``)."""
    m = re.fullmatch(r".+_s(\d+)", name)
    found = [b.name for b in study.blocks if m and int(m.group(1)) in b.seeds]
    if not found:
        seeds = ", ".join(f"{b.name} {seed_ranges(b.seeds)}" for b in study.blocks)
        raise StudyError(f"{study.source}: blocks: run {name!r} " + (f"has seed {m.group(1)}, in no block" if m else
                         "has no _s<seed> suffix") + f"; the blocks' seeds: {seeds}")
    return found[0]


def block_dirs(study: Study, out: str | Path | None = None, root: str | Path = ".") -> dict[str, Path]:
    """{block name: its sweep directory under ``root``}; {"": the sweep directory} without blocks.
    ``out`` (``--out``) moves an unblocked study's runs; a blocked one names its own directories."""
    if not study.blocks:
        return {"": Path(root) / sweep_dir(study, out)}
    if out is not None:
        raise StudyError(f"{study.source}: blocks name their sweep directories ("
                         + ", ".join(f"{b.name}: {b.out or study.out}" for b in study.blocks) + "); --out does not apply")
    return {b.name: Path(root) / sweep_dir(study, b.out) for b in study.blocks}


def machine_block(study: Study) -> Block:
    """The block (``Study.blocks``) this process's machine runs: the one whose ``isa`` is
    ``machine.bits()`` (and whose ``fingerprint``, when registered, is ``machine.fingerprint()``);
    a one-line error naming the blocks otherwise."""
    from timlab.machine import bits, fingerprint

    here = bits()
    names = "; ".join(f"{b.name}: {b.isa}" + (f" {b.fingerprint}" if b.fingerprint else "") for b in study.blocks)
    for b in study.blocks:
        if b.isa == here:
            if b.fingerprint and b.fingerprint != fingerprint():
                raise StudyError(f"{study.source}: blocks: this machine computes as {here} but its fingerprint is "
                                 f"{fingerprint()}, not block {b.name}'s {b.fingerprint}; blocks: {names}")
            return b
    raise StudyError(f"{study.source}: blocks: no block runs on this machine ({here}; pin it with `timlab --isa avx2`); "
                     f"blocks: {names}")


def block_spec(spec, planned: list[PlannedRun], block: str):
    """The sweep spec cut to one block's runs (its named conditions, or its seeds of a seed grid)."""
    keep = [p for p in planned if p.block == block]
    if not keep:  # an empty cut would run the spec's bare base condition, a run nobody registered
        raise StudyError(f"block {block}: holds none of the sweep's runs; nothing to run")
    if SEED in spec.grid:
        seeds = {int(p.name.rsplit("_s", 1)[1]) for p in keep}
        return replace(spec, grid={**spec.grid, SEED: [x for x in spec.grid[SEED] if int(x) in seeds]})
    names = {p.name for p in keep}
    return replace(spec, conditions=tuple(c for c in spec.conditions if c.name in names))


def study_states(planned: list[PlannedRun], dirs: dict[str, Path]) -> dict[str, tuple[str, int]] | None:
    """{run_id: (state, last step)} of the planned runs, each read from its block's directory (a
    directory may hold other runs too: only its block's count); None when no directory has an index."""
    found = {b: states(d) for b, d in dirs.items()}
    if all(x is None for x in found.values()):
        return None
    return {p.run_id: found[p.block][p.run_id] for p in planned
            if found.get(p.block) is not None and p.run_id in found[p.block]}


def check_freezes(study: Study, dirs: dict[str, Path], run_states) -> str:
    """``check_freeze`` in each block's directory (one line; "block NAME: ..." per block)."""
    if list(dirs) == [""]:
        return check_freeze(study, dirs[""], has_runs=run_states is not None or holds_runs(dirs[""]))
    return "; ".join(f"block {b}: {check_freeze(study, d, has_runs=holds_runs(d))}"
                     for b, d in dirs.items())


def states(out: Path) -> dict[str, tuple[str, int]] | None:
    """{run_id: (state, last step)} read live from each run's status.json; None without an index."""
    from timlab.experiments.sweeps.index import INDEX_FILE, read_index

    if not (out / INDEX_FILE).exists():
        return None
    idx = read_index(out)
    return {r: (s, int(n) if pd.notna(n) else 0) for r, s, n in zip(idx["run_id"], idx["state"], idx["last_step"])}
