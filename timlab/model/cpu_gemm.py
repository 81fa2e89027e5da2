"""CPU GEMMs for the exact path whose bits do not depend on the number of torch threads.

With more than one thread, MKL's fp32 GEMM computes small row counts on a different code path
from its one-thread kernel, and a row's result changes in the last bits (measured here, torch
2.13, MKL 2024.2, AVX-512 EPYC: rows 5-7 and 9-11 of an (M, K) x (K, N) GEMM differ with 2
threads for K = 1024-3072, N = 1024-151936; on another 2-core VM the issue reports the cut-off
grows with K, up to 1024 rows at K = 8192). Padding rows cannot fix a cut-off that large, so
the exact path never lets MKL thread a GEMM:

- every fp32/fp64 GEMM of the exact path runs with MKL single-threaded on the calling thread
  (``mkl_set_num_threads_local(1)``, restored afterwards), so it gives one-thread bits;
- when torch has T > 1 threads and the GEMM is large enough to pay for it, the work is split
  into at most T pieces computed concurrently on a small thread pool: a linear's rows (each
  piece keeps >= ``ops.MIN_ROWS`` rows, so by the row-invariance rule each row has the bits it
  has in any larger GEMM), and a batched GEMM's leading (sequence) dimension. Threads thus
  parallelize over rows and sequences, never inside a reduction.

A row's bits are therefore those of the one-thread GEMM for any T. bf16/fp16 GEMMs go through
oneDNN, which does not split the reduction across threads (measured: the same bits on 1, 2 and
4 threads for every row count 1-40, K = 1024, and for the q.k GEMM at head_dim 128), and are
called as they are. Without MKL's thread-local control (a torch build without MKL) the
GEMMs run with torch set to one thread for the call, unsplit. Gradients are not covered: the
backward GEMMs run threaded, so gradient bits may differ between thread counts (they stay
deterministic for a given count).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

MIN_SPLIT_MACS = 1 << 22
"""Split a GEMM across threads only from this many multiply-adds (M x K x N) on; below it the
thread hand-off costs more than it saves and the GEMM runs whole on the calling thread."""

_SPLIT_DTYPES = (torch.float32, torch.float64)
"""GEMMs that MKL computes (and threads); other dtypes are left to oneDNN as they are."""


def _mkl_set_local_threads() -> Callable[[int], int] | None:
    """MKL's ``mkl_set_num_threads_local`` from torch's own MKL, or None when it is not there."""
    if not torch.backends.mkl.is_available():
        return None
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
        if os.path.exists(path):
            try:
                fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local
            except (OSError, AttributeError):
                return None
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
            return fn
    return None


_set_local = _mkl_set_local_threads()
_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] | None = None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """MKL runs single-threaded on this thread inside the block (the previous setting restored)."""
    if _set_local is not None:
        prev = _set_local(1)
        try:
            yield
        finally:
            _set_local(prev)
    else:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(n)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The helper pool (re-made after a fork or when the thread count changes)."""
    global _pool, _pool_key
    key = (os.getpid(), workers)
    if _pool_key != key:
        if _pool is not None and _pool_key is not None and _pool_key[0] == key[0]:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(workers, thread_name_prefix="timlab-gemm")
        _pool_key = key
    return _pool


def _map(fn: Callable[..., torch.Tensor], parts: list[tuple]) -> list[torch.Tensor]:
    """[fn(*p) for p in parts], one-thread MKL each; the calling thread takes the first part."""
    grad = torch.is_grad_enabled()  # grad mode is thread-local: carry the caller's to the pool

    def task(p: tuple) -> torch.Tensor:
        with torch.set_grad_enabled(grad), one_thread():
            return fn(*p)

    pool = _executor(torch.get_num_threads() - 1)  # len(parts) <= the thread count
    futures = [pool.submit(task, p) for p in parts[1:]]
    first = task(parts[0])
    return [first] + [f.result() for f in futures]


def _pieces(rows: int, macs: int, min_rows: int) -> int:
    """How many pieces to split ``rows`` into: 1 unless threads, MKL control and size allow."""
    threads = torch.get_num_threads()
    if threads == 1 or _set_local is None or macs < MIN_SPLIT_MACS:
        return 1
    return max(1, min(threads, rows // min_rows))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (M, K) with M >= min_rows, bits independent of the thread count.

    The rows are split into pieces of >= ``min_rows`` rows (the row count from which every row
    of the GEMM has the same bits whatever M is).
    """
    if x.dtype not in _SPLIT_DTYPES or torch.get_num_threads() == 1:
        return F.linear(x, weight, bias)
    m, k = x.shape
    n = _pieces(m, m * k * weight.shape[0], min_rows)
    if n == 1:
        with one_thread():
            return F.linear(x, weight, bias)
    return torch.cat(_map(lambda p: F.linear(p, weight, bias), [(p,) for p in x.tensor_split(n)]))  # (M, N)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` for batched a (B, ..., M, K), b (B, ..., K, N), bits independent of
    the thread count: the batch dimension (sequences) is split across threads."""
    if a.dtype not in _SPLIT_DTYPES or torch.get_num_threads() == 1:
        return torch.matmul(a, b)
    n = _pieces(a.shape[0], a.numel() * b.shape[-1], 1)
    if n == 1:
        with one_thread():
            return torch.matmul(a, b)
    return torch.cat(_map(torch.matmul, list(zip(a.tensor_split(n), b.tensor_split(n)))))  # (B, ..., M, N)
