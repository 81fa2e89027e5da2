# Two commands on a fresh machine (see README):
#   make demo   installs into .venv and runs the main job (timlab demo) on the CPU
#   make test   installs into .venv (with test extras and the optional integrations) and runs the test suite;
#               its SFT models go to a temporary TIMLAB_CACHE that it names first and deletes at the end
.PHONY: demo quick test bench venv clean

venv:
	bash scripts/setup_venv.sh test

demo:
	bash scripts/setup_venv.sh test
	OMP_NUM_THREADS=1 .venv/bin/timlab demo --out demo_out

quick:
	bash scripts/setup_venv.sh test
	OMP_NUM_THREADS=1 .venv/bin/timlab demo --quick --out demo_out_quick

# The suite runs on two pytest-xdist workers (-n 2; a plain `pytest` runs it serially). The second
# pytest run recomputes FINDINGS under other BLAS and numpy SIMD kernels than the
# machine's own (OpenBLAS's Sandybridge kernels, numpy without its AVX2/AVX-512 loops): a
# published number must not depend on which kernels the CPU picks. It runs at pyproject's own
# verbosity (-q there; a second -q would drop its "1 passed" line), so make test ends on that line.
test:
	bash scripts/setup_venv.sh test integrations
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -rs -n 2
	@echo "second pass: FINDINGS blocks under other BLAS and SIMD kernels"
	OMP_NUM_THREADS=1 OPENBLAS_CORETYPE=Sandybridge NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4" \
	  .venv/bin/python -m pytest tests/test_findings.py -k findings_blocks

bench:
	OMP_NUM_THREADS=1 .venv/bin/python bench/engines.py --json bench/engines.json
	OMP_NUM_THREADS=1 .venv/bin/python bench/vs_trl.py --json bench/vs_trl.json

clean:
	rm -rf .venv demo_out demo_out_quick
