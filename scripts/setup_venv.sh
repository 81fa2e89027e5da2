#!/usr/bin/env bash
# Create .venv and install timlab with the given extras, without ever pulling a CUDA torch:
# a machine whose Python already has torch >= 2.4 keeps it (the venv sees system packages);
# otherwise torch==2.13.0 (the CPU wheel on this project's machines) is installed first, and
# every later install is constrained to the torch version present.
#
# A second argument `integrations` also installs the optional integrations whose tests would
# otherwise skip: verl 0.9.1 (with --no-deps: its full dependency list pins a CUDA stack; the
# plug-in and the tests need only the packages below), ray, omegaconf, tensorboard and triton
# (the Triton kernels' tests run in its CPU interpreter). `make test`, and so CI, asks for them.
set -euo pipefail
extras="${1:-test}"
with="${2:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python - <<'PY' 2>/dev/null
import torch, sys
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 4) else 1)
PY
then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv/constraints.txt
.venv/bin/python -m pip install -q -c .venv/constraints.txt -e ".[${extras}]"
if [ "$with" = integrations ]; then
  .venv/bin/python -m pip install -q -c .venv/constraints.txt \
    ray omegaconf tensorboard triton \
    packaging codetiming orjson pydantic "tensordict>=0.8,<=0.10.0,!=0.9.0"
  .venv/bin/python -m pip install -q --no-deps verl==0.9.1
elif [ -n "$with" ]; then
  echo "setup_venv.sh: unknown second argument '$with'; valid choices: integrations" >&2
  exit 2
fi
