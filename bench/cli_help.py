"""Time ``timlab ... --help`` (and ``timlab config``) in fresh processes: CPU time and wall time.

    python bench/cli_help.py /path/to/a/checkout     # 5 runs per command; min CPU, min and median wall

Help must not import torch (tests/test_cli_help.py checks that); this shows what it costs.
"""
import os, resource, subprocess, sys, time
tree = sys.argv[1]
env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
for c in ["--help", "probe --help", "train --help", "gradcheck --help", "report --help", "config"]:
    cpus, walls = [], []
    for _ in range(5):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "timlab", *c.split()], cwd=tree, env=env, capture_output=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - t0)
        cpus.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    print(f"{c}: CPU min {min(cpus):.2f} s, wall min {min(walls):.2f} s median {sorted(walls)[2]:.2f} s")
