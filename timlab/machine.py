"""The CPU instruction set a run computes with, and how to pin it.

Runs are bitwise repeatable on one machine, not across CPU instruction sets: on an AVX-512 CPU
torch, oneDNN and MKL dispatch other kernels than on an AVX2 one, so the same seed takes another
(equally exact) trajectory. Capping all three at AVX2 (``PIN_ENV``, set before torch loads) makes
an AVX-512 AMD machine compute the bits an AVX2 AMD machine computes: an SFT warm start and 90 RL
steps built both ways gave the same SHA-256 of the weights (docs/FINDINGS.md, erosion study).

MKL picks its kernels by CPU vendor as well as by instruction set. On an Intel CPU capped at AVX2,
MKL's fp32 GEMM gives a row other bits at other row counts far past the exact path's padding
(``ops.MIN_ROWS``; measured on a Sapphire Rapids-class Xeon: rows differ whenever M mod 6 is 1-3,
up to M = 55, and up to M = 128 at N <= 32), so the zero-mismatch guard fails at step 1. There
``PIN_ENV`` also asks for MKL's strict conditional numerical reproducibility on its AVX2 branch
(``MKL_CBWR=AVX2,STRICT``), under which every row has the same bits at every row count. An Intel
machine pinned this way is exact, but it does not compute the AMD machines' bits: ``bits()``
names the two apart (``avx2`` and ``avx2-intel``), and ``fingerprint()`` tells any two
processes apart that round differently in the operations a run uses.

``timlab --isa avx2 ...`` sets ``PIN_ENV`` and re-executes itself before torch loads; a sweep spec
may say ``isa: avx2`` so that a study spanning machines cannot mix instruction sets; every
checkpoint records ``describe()`` so that a resume on another instruction set is named, and a
sweep folder records ``bits()`` and ``fingerprint()`` of its first sweep and refuses a sweep that
computes other bits.
"""

from __future__ import annotations

import os
from pathlib import Path

ISAS = ("native", "avx2")
"""``native``: whatever the machine has; ``avx2``: torch, oneDNN and MKL capped at AVX2."""

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Environment that caps torch, oneDNN and MKL at AVX2 (read once, when torch is imported)."""

INTEL_STRICT = {"MKL_CBWR": "AVX2,STRICT"}
"""Added to the pin on Intel CPUs: MKL's strict reproducibility mode on its AVX2 branch, without
which MKL's AVX2 GEMM on Intel is not row-invariant (see the module's docstring)."""


def _cpu_field(name: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first ``name : value`` of /proc/cpuinfo (None where it cannot tell)."""
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        return None
    return None


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """``GenuineIntel``, ``AuthenticAMD``, ... (None where /proc/cpuinfo cannot tell)."""
    return _cpu_field("vendor_id", cpuinfo)


def pin_vars(vendor: str | None = None) -> dict[str, str]:
    """The environment that pins a CPU of ``vendor`` (default: this machine's) to AVX2."""
    vendor = cpu_vendor() if vendor is None else vendor
    return {**AVX2_CAPS, **(INTEL_STRICT if vendor == "GenuineIntel" else {})}


PIN_ENV = pin_vars()
"""What ``--isa avx2`` sets on this machine: ``AVX2_CAPS``, plus ``INTEL_STRICT`` on an Intel CPU."""


KEEP_CPU_ENV = "TIMLAB_KEEP_CPU_ENV"
"""Set to 1 so that importing ``timlab.model`` leaves MKL's and oneDNN's settings as they are."""


def exact_cpu_env(vendor: str | None = None, flags: str | None = None) -> dict[str, str]:
    """What the exact CPU path needs set on a CPU of ``vendor`` with cpuinfo ``flags`` (default:
    this machine's), unpinned; empty on the AMD CPUs every published run used.

    - Intel: ``MKL_CBWR=AUTO,STRICT``. Without it MKL's fp32 GEMM with a bias (beta = 1), called
      single-threaded from a helper thread (``cpu_gemm``'s row split), gives other bits than the
      same call on the main thread, so a linear's bits depend on the torch thread count (measured on
      a Sapphire Rapids-class Xeon: rows 17-32 of a (33, 1024) x (1024, 2048) linear on 2 threads).
    - A CPU with AMX: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_FP16``, oneDNN without its AMX kernels, whose
      bf16 results broke the zero-mismatch guard at Qwen3-0.6B's widths (the same Xeon).
    """
    vendor = cpu_vendor() if vendor is None else vendor
    flags = (_cpu_field("flags") or "") if flags is None else flags
    env = {}
    if vendor == "GenuineIntel":
        env["MKL_CBWR"] = "AUTO,STRICT"
    if "amx_bf16" in flags.split():
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_FP16"
    return env


def prepare_exact_cpu(environ: dict | None = None) -> dict[str, str]:
    """Set each variable of ``exact_cpu_env()`` that ``environ`` (default: this process's) leaves
    unset; returns the ones set. MKL and oneDNN read them at their first call, not at import, so
    this works after ``import torch`` and before the first matmul. Importing ``timlab.model`` (the
    exact path: engines, trainer, CLI) calls it, and so does ``fingerprint()``; the pure layers and
    the plug-ins do not, so a TRL or verl user's bf16 keeps oneDNN's AMX kernels (5-13x faster on
    a bf16 linear on the Intel machine, bench/RESULTS.md).
    A variable the user set (the ``--isa avx2`` pin sets both) is left as it is, and
    ``TIMLAB_KEEP_CPU_ENV=1`` leaves all of them (e.g. to keep AMX's bf16 speed where exactness
    does not matter)."""
    environ = os.environ if environ is None else environ
    if environ.get(KEEP_CPU_ENV) == "1":
        return {}
    added = {k: v for k, v in exact_cpu_env().items() if k not in environ}
    environ.update(added)
    return added


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
    flags = _cpu_field("flags", cpuinfo)
    return None if flags is None else "avx512f" in flags.split()


def _exact_values(n: int, salt: int):
    """n float32 values in [-2, 2) that every machine represents exactly (no RNG, no libm)."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return (((i * 2654435761 + salt * 40503) % 4093) - 2046).to(torch.float32) / 1024


FINGERPRINT_GEMMS = ((1, 64, 64), (3, 64, 48), (7, 128, 96), (16, 64, 16), (16, 64, 200), (33, 256, 64),
                     (64, 96, 512), (128, 512, 128))
"""(M, K, N) of the linears ``fingerprint`` computes: decode-sized and trainer-sized row counts,
narrow and wide outputs, the tiny presets' widths."""

_fingerprint: str | None = None


def fingerprint() -> str:
    """12 hex digits of a SHA-256 over the bits of the operations a run is built from (fp32 linears
    at ``FINGERPRINT_GEMMS`` and their transposed products, a batched matmul, softmax, log-softmax,
    SiLU, exp, rsqrt, sin, cos, sqrt, and bf16 and fp16 linears) on fixed exact inputs, one torch
    thread. Two processes with different fingerprints compute different bits; equal fingerprints
    make equal bits likely, not certain. Computed once per process (about 30 ms), under the settings
    of ``prepare_exact_cpu`` (what a run computes with)."""
    global _fingerprint
    if _fingerprint is None:
        prepare_exact_cpu()
        import hashlib

        import torch
        import torch.nn.functional as F

        digest = hashlib.sha256()

        def add(t: torch.Tensor) -> None:
            digest.update(t.detach().float().contiguous().numpy().tobytes())

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                for m, k, n in FINGERPRINT_GEMMS:
                    x = _exact_values(m * k, 1).view(m, k)
                    y = F.linear(x, _exact_values(n * k, 2).view(n, k))  # (M, N)
                    add(y)
                    add(torch.matmul(x.t(), y))  # (K, N): a weight gradient's layout
                a = _exact_values(4 * 8 * 16, 3).view(4, 8, 16)
                scores = torch.matmul(a, _exact_values(4 * 16 * 40, 4).view(4, 16, 40))  # (4, 8, 40)
                for t in (scores, torch.softmax(scores, -1), torch.log_softmax(scores, -1), F.silu(scores),
                          torch.exp(scores), torch.rsqrt(scores.pow(2).mean(-1) + 1e-6), torch.sin(scores),
                          torch.cos(scores), torch.sqrt(scores.abs())):
                    add(t)
                for dtype in (torch.bfloat16, torch.float16):
                    x = _exact_values(16 * 64, 5).view(16, 64).to(dtype)
                    add(F.linear(x, _exact_values(64 * 64, 6).view(64, 64).to(dtype)))
        finally:
            torch.set_num_threads(threads)
        _fingerprint = digest.hexdigest()[:12]
    return _fingerprint


def describe() -> dict:
    """What decides the bits this process computes: torch's version and dispatched CPU capability,
    whether the AVX2 pin is in effect, the CPU's vendor (MKL dispatches by it) and ``fingerprint()``."""
    import torch

    # plain str and bool, so that a checkpoint holding this loads with weights_only=True
    return {"torch": str(torch.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "pinned_avx2": _pinned(os.environ), "vendor": str(cpu_vendor()), "fingerprint": fingerprint()}


def summary(described: dict | None = None) -> str:
    """``describe()`` (default: this process's) as one line for people, e.g. ``torch 2.13.0,
    CPU capability AVX2, AuthenticAMD, fingerprint 0123456789ab`` (``, capped at AVX2 by --isa
    avx2`` when pinned; vendor and fingerprint where the record has them)."""
    d = describe() if described is None else described
    return (f"torch {d['torch']}, CPU capability {d['cpu_capability']}"
            + (", capped at AVX2 by --isa avx2" if d.get("pinned_avx2") else "")
            + (f", {d['vendor']}" if d.get("vendor") not in (None, "None") else "")
            + (f", fingerprint {d['fingerprint']}" if d.get("fingerprint") else ""))


REPEATS_NOTE = ("runs repeat bit for bit on machines with the same fingerprint and torch, not across them; "
                "README, 'What the demo shows', has the demo's tables for AVX2 and docs/demo.md for AVX512 (AMD EPYCs)")
"""What the demo says under its machine line: which published table a reader should compare with."""


def computes_as(isa: str) -> bool:
    """Whether this process computes the bits ``isa`` names: always for ``native``; for ``avx2``,
    torch dispatches AVX2 and oneDNN and MKL cannot use more (the pin is set, or the CPU has no
    AVX-512)."""
    if check_isa(isa) == "native":
        return True
    here = describe()
    return here["cpu_capability"] == "AVX2" and (here["pinned_avx2"] or _cpu_has_avx512() is False)


PINNED_LABELS = ("avx2", "avx2-intel")
"""What ``bits()`` says in a process pinned to AVX2 (``--isa avx2``): on a non-Intel CPU, and on an
Intel one (other bits: MKL's strict AVX2 path). The machine labels a study's ``blocks`` can name."""


def bits() -> str:
    """A name for the instruction set this process computes with, meant to be equal for two
    processes exactly when they compute the same bits (torch's version aside; ``fingerprint()``
    checks it): ``avx2`` when torch, oneDNN and MKL are all held to AVX2 (pinned, or a CPU without
    AVX-512) on a non-Intel CPU, ``avx2-intel`` for the same on an Intel CPU with MKL strict (the
    pin there; `` (MKL not strict)`` when it is not), else torch's CPU capability (``AVX512``,
    ``DEFAULT``, ...), with `` (oneDNN and MKL not capped)`` where torch dispatches AVX2 but the
    CPU's AVX-512 support is unknown or unpinned."""
    if computes_as("avx2"):
        if cpu_vendor() != "GenuineIntel":
            return "avx2"
        strict = all(os.environ.get(k) == v for k, v in INTEL_STRICT.items())
        return "avx2-intel" if strict else "avx2-intel (MKL not strict)"
    capability = describe()["cpu_capability"]
    return f"{capability} (oneDNN and MKL not capped)" if capability == "AVX2" else capability


def resume_note(saved: dict | None) -> str | None:
    """One line when a checkpoint written under ``saved`` (its ``describe()``) is resumed on a
    process that computes differently; None when they agree or the checkpoint predates the record."""
    if not isinstance(saved, dict):
        return None
    here = describe()
    differ = [f"{k} {saved.get(k)} there, {here[k]} here" for k in ("cpu_capability", "torch", "fingerprint")
              if k in saved and saved[k] != here[k]]
    if not differ:
        return None
    return ("resuming on another instruction set or torch (" + "; ".join(differ) + "): the run goes on exactly, "
            "but not bit for bit like an uninterrupted run (pin the ISA with `timlab --isa avx2`)")


__all__ = ["ISAS", "PINNED_LABELS", "AVX2_CAPS", "INTEL_STRICT", "PIN_ENV", "REPEATS_NOTE", "check_isa", "cpu_vendor", "pin_vars",
           "exact_cpu_env", "prepare_exact_cpu",
           "pin_env", "fingerprint", "describe", "summary", "computes_as", "bits", "resume_note"]
