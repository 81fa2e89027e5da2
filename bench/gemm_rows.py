"""Rule 1 of the exact path (a row of an fp32 linear has the same bits at every row count >= 16)
under each way of pinning this machine, with the fingerprint each computes.

    python bench/gemm_rows.py

Each setting runs in a child process (the environment must be set before torch loads): native as
torch ships (``TIMLAB_KEEP_CPU_ENV=1``), native as ``timlab.model`` sets it (``machine.exact_cpu_env``:
MKL strict and oneDNN without AMX on Intel/AMX CPUs, nothing on AMD), the AVX2 caps alone
(``machine.AVX2_CAPS``), and this machine's ``--isa avx2`` pin (``machine.PIN_ENV``: the caps, plus
``MKL_CBWR=AVX2,STRICT`` on an Intel CPU). Prints, per setting, the (K, N, M) cases of
``ops.row_violations`` that differ out of all probed, and the fingerprint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from timlab import machine  # noqa: E402  (imports no torch)

CHILD = """
import json, torch
from timlab import machine
from timlab.model.ops import ROW_PROBE_SHAPES, MIN_ROWS, row_violations
bad = row_violations()
print(json.dumps({"bad": len(bad), "cases": len(ROW_PROBE_SHAPES) * (128 - MIN_ROWS + 1), "first": bad[:3],
                  "capability": str(torch.backends.cpu.get_cpu_capability()), "fingerprint": machine.fingerprint()}))
"""


def main() -> None:
    base = {k: v for k, v in os.environ.items()
            if k not in {**machine.PIN_ENV, **machine.exact_cpu_env(), machine.KEEP_CPU_ENV: ""}}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    print(f"CPU vendor {machine.cpu_vendor()}, AVX-512 {machine._cpu_has_avx512()}")
    print(f"{'setting':<34} {'capability':<10} {'rows differ':>14}  fingerprint   first cases (K, N, M)")
    keep = {machine.KEEP_CPU_ENV: "1"}
    for name, env in [("native, as torch ships", keep), ("native, as timlab.model sets it", {}),
                      ("AVX2 caps alone", {**machine.AVX2_CAPS, **keep}), ("--isa avx2 (PIN_ENV)", machine.PIN_ENV)]:
        res = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                             check=True)
        r = json.loads(res.stdout)
        print(f"{name:<34} {r['capability']:<10} {r['bad']:>6} of {r['cases']:<5}  {r['fingerprint']}  {r['first']}")


if __name__ == "__main__":
    main()
