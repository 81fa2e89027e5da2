#!/usr/bin/env bash
# Every GPU measurement the project has, in one command (for a machine with a CUDA GPU, torch,
# triton and transformers; timlab runs from the checkout). Logs and JSON go to ${OUT:-/tmp/gpu}.
#   bash bench/gpu.sh            # the engine, kernels and training: about 5-8 minutes on one H100
#   bash bench/gpu.sh loop       # the device-side decode loop and its CUDA graphs, then GRPO on them: about 8 minutes
set -uo pipefail
PART=${1:-core}
case $PART in core|loop) ;; *) echo "bench/gpu.sh: part '$PART'; valid choices: core, loop" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
step() { echo; echo "=== $1"; shift; "$@" 2>&1 | tee -a "$OUT/gpu.log"; echo "rc ${PIPESTATUS[0]}"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/gpu.log"
if [ "$PART" = loop ]; then
  # DeviceLoop (timlab/engines/device_loop.py): exactness against the trainer with the decode step
  # replayed as CUDA graphs, over the randomized case space, then its speed at Qwen3-0.6B width
  step "device loop + CUDA graphs vs the trainer, randomized search" timeout 200 $PY bench/exactness_fuzz.py --cases 40 --device cuda --device-loop 8 --cuda-graphs --every 5 --json "$OUT/fuzz_loop.json"
  step "rollout speed: host loop, device loop, CUDA graphs, HF generate" timeout 240 $PY bench/gpu_rollout.py --device cuda --batches 128,256 --new-tokens 64 --repeats 2 --json "$OUT/gpu_rollout_loop.json"
  step "GRPO on CUDA on the graphed decode loop, guard on" timeout 300 $PY -m timlab train --preset default --set run.device=cuda --set run.steps=30 --set rollout.decode_loop=graphs --run-dir /tmp/train_graphs --quiet
  step "its metrics" $PY -c "import pandas as pd; m = pd.read_parquet('/tmp/train_graphs/metrics.parquet'); cols = [c for c in m.columns if 'k3' in c or c in ('step', 'mismatch/max_abs_diff', 'train/reward_mean', 'train/step_time_s')]; print(m[cols].describe().T.to_string())"
  exit 0
fi
step "kernel tests, compiled" env TRITON_INTERPRET=0 timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py
step "kernels vs cuBLAS/SDPA" timeout 300 $PY bench/kernels.py --device cuda --json "$OUT/kernels.json"
step "exact engine at Qwen3-0.6B width" timeout 400 $PY bench/gpu_exact.py --device cuda --json "$OUT/gpu_exact.json"
step "rollout speed vs HF generate and the roofline, Qwen3-0.6B width" timeout 500 $PY bench/gpu_rollout.py --device cuda --repeats 2 --json "$OUT/gpu_rollout.json"
step "engine throughput, tiny model" timeout 300 $PY bench/engines.py --device cuda --dtype bfloat16 --engines exact,fast,hf --repeats 5 --json "$OUT/engines_tiny.json"
step "GRPO on CUDA, guard on" timeout 400 $PY -m timlab train --preset smoke --set run.device=cuda --run-dir /tmp/train_smoke --quiet
step "its metrics" $PY -c "import pandas as pd; m = pd.read_parquet('/tmp/train_smoke/metrics.parquet'); cols = [c for c in m.columns if 'k3' in c or c in ('step', 'mismatch/max_abs_diff', 'train/reward_mean', 'train/step_time_s')]; print(m[cols].describe().T.to_string())"
step "GRPO on CUDA, default preset, 30 steps" timeout 300 $PY -m timlab train --preset default --set run.device=cuda --set run.steps=30 --run-dir /tmp/train_default --quiet
step "its metrics" $PY -c "import pandas as pd; m = pd.read_parquet('/tmp/train_default/metrics.parquet'); cols = [c for c in m.columns if 'k3' in c or c in ('step', 'mismatch/max_abs_diff', 'train/reward_mean', 'train/step_time_s')]; print(m[cols].describe().T.to_string())"
exit 0
