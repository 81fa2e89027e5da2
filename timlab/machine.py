"""The CPU instruction set a run computes with, and how to pin it.

Runs are bitwise repeatable on one machine, not across CPU instruction sets: on an AVX-512 CPU
torch, oneDNN and MKL dispatch other kernels than on an AVX2 one, so the same seed takes another
(equally exact) trajectory. Capping all three at AVX2 (``PIN_ENV``, set before torch loads) makes
an AVX-512 machine compute the bits an AVX2 machine computes: an SFT warm start and 90 RL steps
built both ways gave the same SHA-256 of the weights (docs/FINDINGS.md, erosion study).

``timlab --isa avx2 ...`` sets ``PIN_ENV`` and re-executes itself before torch loads; a sweep spec
may say ``isa: avx2`` so that a study spanning machines cannot mix instruction sets; every
checkpoint records ``describe()`` so that a resume on another instruction set is named, and a
sweep folder records ``bits()`` of its first sweep and refuses a sweep that computes other bits.
"""

from __future__ import annotations

import os
from pathlib import Path

ISAS = ("native", "avx2")
"""``native``: whatever the machine has; ``avx2``: torch, oneDNN and MKL capped at AVX2."""

PIN_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Environment that caps torch, oneDNN and MKL at AVX2 (read once, when torch is imported)."""


def check_isa(isa: str, where: str = "--isa") -> str:
    from timlab.errors import UsageError

    if isa not in ISAS:
        raise UsageError(f"{where} {isa!r}; valid choices: {', '.join(ISAS)}")
    return isa


def _pinned(environ) -> bool:
    return all(environ.get(k) == v for k, v in PIN_ENV.items())


def pin_env(isa: str, environ: dict | None = None) -> dict | None:
    """The environment to re-execute under so that ``isa`` holds, or None when ``environ`` (default:
    this process's) already gives it. ``native`` never asks for a change."""
    environ = os.environ if environ is None else environ
    if check_isa(isa) == "native" or _pinned(environ):
        return None
    return {**environ, **PIN_ENV}


def _cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU advertises AVX-512 (None where /proc/cpuinfo cannot tell)."""
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return "avx512f" in line.split()
    except OSError:
        return None
    return None


def describe() -> dict:
    """What decides the bits this process computes: torch's version and dispatched CPU capability,
    and whether the AVX2 pin is in effect."""
    import torch

    # plain str and bool, so that a checkpoint holding this loads with weights_only=True
    return {"torch": str(torch.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "pinned_avx2": _pinned(os.environ)}


def summary(described: dict | None = None) -> str:
    """``describe()`` (default: this process's) as one line for people, e.g. ``torch 2.13.0,
    CPU capability AVX2`` (``, capped at AVX2 by --isa avx2`` when pinned)."""
    d = describe() if described is None else described
    return (f"torch {d['torch']}, CPU capability {d['cpu_capability']}"
            + (", capped at AVX2 by --isa avx2" if d.get("pinned_avx2") else ""))


REPEATS_NOTE = ("runs repeat bit for bit on machines with the same CPU capability and torch, not across them; "
                "README, 'What the demo shows', has the demo's tables for AVX2 and for AVX512")
"""What the demo says under its machine line: which published table a reader should compare with."""


def computes_as(isa: str) -> bool:
    """Whether this process computes the bits ``isa`` names: always for ``native``; for ``avx2``,
    torch dispatches AVX2 and oneDNN and MKL cannot use more (the pin is set, or the CPU has no
    AVX-512)."""
    if check_isa(isa) == "native":
        return True
    here = describe()
    return here["cpu_capability"] == "AVX2" and (here["pinned_avx2"] or _cpu_has_avx512() is False)


def bits() -> str:
    """A name for the instruction set this process computes with, equal for two processes exactly
    when they compute the same bits (torch's version aside): ``avx2`` when torch, oneDNN and MKL
    are all held to AVX2 (pinned, or a CPU without AVX-512), else torch's CPU capability
    (``AVX512``, ``DEFAULT``, ...), with `` (oneDNN and MKL not capped)`` where torch dispatches
    AVX2 but the CPU's AVX-512 support is unknown or unpinned."""
    if computes_as("avx2"):
        return "avx2"
    capability = describe()["cpu_capability"]
    return f"{capability} (oneDNN and MKL not capped)" if capability == "AVX2" else capability


def resume_note(saved: dict | None) -> str | None:
    """One line when a checkpoint written under ``saved`` (its ``describe()``) is resumed on a
    process that computes differently; None when they agree or the checkpoint predates the record."""
    if not isinstance(saved, dict):
        return None
    here = describe()
    differ = [f"{k} {saved.get(k)} there, {here[k]} here" for k in ("cpu_capability", "torch")
              if k in saved and saved[k] != here[k]]
    if not differ:
        return None
    return ("resuming on another instruction set or torch (" + "; ".join(differ) + "): the run goes on exactly, "
            "but not bit for bit like an uninterrupted run (pin the ISA with `timlab --isa avx2`)")


__all__ = ["ISAS", "PIN_ENV", "REPEATS_NOTE", "check_isa", "pin_env", "describe", "summary", "computes_as", "bits",
           "resume_note"]
