"""The batch-invariant Triton kernels (``timlab.kernels``): the exact path's forward on CUDA.

Without a GPU they run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set below
before Triton is imported). Interpreted kernels keep the compiled ones' tiles, masks and key
order, but sum products over k instead of calling tensor-core dots, and the row-wise kernels
take 16 rows per program (``timlab.kernels.runtime``, ``rowwise``): what a GPU's dots do is not
tested here. On a GPU, ``TRITON_INTERPRET=0 pytest tests/test_kernels.py`` runs them compiled.

Checked: agreement with torch (as accurate as the stock kernel, within 2x its error against a
float64 reference, plus one unit in the last place), per-row bitwise invariance for M = 1..70
rows at shifting positions in the tiles, padded vs unpadded batches, one decode query vs the
trainer's many, and the exact engine's rollout log-probs vs the trainer's forward, both run
through the kernels: ``torch.equal``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import timlab.kernels
from timlab.errors import UsageError

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.float32, torch.bfloat16)

needs_triton = pytest.mark.skipif(not timlab.kernels.available(), reason="Triton is not installed (timlab[gpu])")


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def assert_as_accurate_as_torch(out: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor) -> None:
    """out's error against the float64 ``exact`` is at most 2x the stock kernel's, plus one ulp.

    ``stock`` may be a tuple of references (e.g. the stock kernel and an in-order fp32 sum): the
    least accurate of them sets the bar.
    """
    exact = exact.double()
    err = float((out.double() - exact).abs().max())
    stock_err = max(float((s.double() - exact).abs().max()) for s in (stock if isinstance(stock, tuple) else (stock,)))
    ulp = torch.finfo(out.dtype).eps * float(exact.abs().max())
    assert err <= 2 * stock_err + ulp, (err, stock_err, ulp)


def _attention_inputs(dtype, *, B=2, H=4, H_kv=2, S=40, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(B, H, S, D, g=g, dtype=dtype), randn(B, H_kv, S, D, g=g, dtype=dtype), randn(B, H_kv, S, D, g=g, dtype=dtype)
    allowed = torch.ones(S, S, dtype=torch.bool, device=DEVICE).tril().expand(B, 1, S, S).clone()
    allowed[0, :, :, :5] = False  # left padding of sequence 0 ...
    allowed[0, :, torch.arange(S), torch.arange(S)] = True  # ... every query still sees itself
    return q, k, v, allowed, D**-0.5


# ------------------------------------------------------------------------------ agreement
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
@pytest.mark.parametrize("M, K, N, bias", [(70, 100, 50, True), (3, 200, 130, False)])
def test_linear_agrees_with_torch(dtype, M, K, N, bias):
    from timlab.kernels import linear

    g = torch.Generator().manual_seed(0)
    x, w = randn(M, K, g=g, dtype=dtype), randn(N, K, g=g, dtype=dtype)
    b = randn(N, g=g, dtype=dtype) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    out = linear(x, w, b)
    # The kernel reduces K in order, one fp32 product at a time; cuBLAS splits the sum and is more
    # accurate (on an H100, fp32, K = 200: 2.2e-5 vs 6.6e-6, the in-order sum's 2.2e-5 exactly).
    in_order = torch.zeros(M, N, device=DEVICE)
    for kk in range(K):
        in_order = torch.addcmul(in_order, x[:, kk : kk + 1].float(), w[:, kk][None, :].float())
    if b is not None:
        in_order = in_order + b.float()
    assert_as_accurate_as_torch(out, (F.linear(x, w, b), in_order.to(dtype)), exact)
    assert torch.equal(linear(x[None], w, b), out[None])  # (..., K) inputs


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_rms_norm_and_log_softmax_agree_with_torch(dtype):
    from timlab.kernels import log_softmax, rms_norm
    from timlab.kernels.rowwise import rms_norm_reference

    g = torch.Generator().manual_seed(1)
    x, w = randn(37, 96, g=g, dtype=dtype), (1 + 0.1 * randn(96, g=g)).to(dtype)
    out, stock = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert out.dtype == stock.dtype
    # both round the normalized row to the input dtype, so compare with that reference's rounding
    assert_as_accurate_as_torch(out, stock, rms_norm_reference(x.double(), w.double(), 1e-6))
    logits = 4 * randn(5, 3, 1500, g=g)  # rows longer than one 1024-lane block
    assert_as_accurate_as_torch(log_softmax(logits), torch.log_softmax(logits, -1),
                                torch.log_softmax(logits.double(), -1))
    short = logits[..., :40]
    assert_as_accurate_as_torch(log_softmax(short, dim=1), torch.log_softmax(short, 1),
                                torch.log_softmax(short.double(), 1))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_attention_agrees_with_the_cpu_path(dtype):
    from timlab.kernels import fixed_length_attention
    from timlab.model import ops

    q, k, v, allowed, scale = _attention_inputs(dtype)
    with ops.kernel_backend("torch"):  # the stock kernels, and a float64 reference (no fp64 kernel)
        stock = ops.fixed_length_attention(q, k, v, allowed, scale)
        exact = ops.fixed_length_attention(q.double(), k.double(), v.double(), allowed, scale)
    assert_as_accurate_as_torch(fixed_length_attention(q, k, v, allowed, scale), stock, exact)


@needs_triton
@pytest.mark.skipif(ON_GPU, reason="the interpreter's stand-ins only")
def test_the_compiled_configuration_computes_the_same_function(monkeypatch):
    """What a GPU runs, as far as the interpreter can: tl.dot (fp32 only: the interpreter reads
    bf16 dots as integers) and one row per program; the values match the interpreted stand-ins."""
    from timlab.kernels import attention, fixed_length_attention, linear, log_softmax, matmul, rms_norm, rowwise

    g = torch.Generator().manual_seed(6)
    x, w, b, nw = randn(70, 100, g=g), randn(50, 100, g=g), randn(50, g=g), 1 + 0.1 * randn(100, g=g)
    q, k, v, allowed, scale = _attention_inputs(torch.float32, S=24)
    stand_in = (linear(x, w, b), fixed_length_attention(q, k, v, allowed, scale), rms_norm(x, nw, 1e-6), log_softmax(x))
    monkeypatch.setattr(matmul, "INTERPRETED", False)
    monkeypatch.setattr(attention, "INTERPRETED", False)
    monkeypatch.setattr(rowwise, "ROWS", 1)
    compiled = (linear(x, w, b), fixed_length_attention(q, k, v, allowed, scale), rms_norm(x, nw, 1e-6), log_softmax(x))
    torch.testing.assert_close(compiled[:2], stand_in[:2], rtol=1e-5, atol=1e-5)  # other dot, other rounding
    assert torch.equal(compiled[2], stand_in[2]) and torch.equal(compiled[3], stand_in[3])  # same per-row arithmetic


# ------------------------------------------------------------------------------ invariance
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_linear_rows_do_not_depend_on_row_count_or_position(dtype):
    """M = 1..70 rows starting at a shifting row: each row's bits equal its row of one big call,
    at another position in its 64-row tile; with autograd on too (the trainer's forward)."""
    from timlab.kernels import linear

    g = torch.Generator().manual_seed(2)
    x, w, b = randn(140, 48, g=g, dtype=dtype), randn(40, 48, g=g, dtype=dtype), randn(40, g=g, dtype=dtype)
    full = linear(x, w, b)  # (140, 40)
    for m in range(1, 71):
        s = (7 * m) % 70
        assert torch.equal(linear(x[s : s + m], w, b), full[s : s + m]), m
    with torch.enable_grad():
        xg = x[5:26].clone().requires_grad_(True)
        assert torch.equal(linear(xg, w, b).detach(), full[5:26])


@needs_triton
def test_linear_specializes_only_on_what_the_layer_fixes():
    """Triton may specialize the linear on N, K and the weight's strides (the same in every call on
    a weight), never on M or the input's and output's strides (they change between the trainer's
    call and a decode step's, and a second compiled kernel may round otherwise)."""
    from timlab.kernels import matmul

    ints = [a for a in matmul._linear_kernel.arg_names if a in ("M", "N", "K") or a.startswith("stride_")]
    per_call = [a for a in ints if a == "M" or a.startswith(("stride_x", "stride_y"))]
    assert per_call == ["M", "stride_xm", "stride_xk", "stride_ym", "stride_yn"]
    assert list(matmul.ROW_ARGS) == per_call


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_row_wise_kernels_do_not_depend_on_row_count(dtype):
    from timlab.kernels import log_softmax, rms_norm

    g = torch.Generator().manual_seed(3)
    x, w = randn(140, 72, g=g, dtype=dtype), (1 + 0.1 * randn(72, g=g)).to(dtype)
    logits = 3 * randn(140, 40, g=g)
    full_norm, full_lsm = rms_norm(x, w, 1e-5), log_softmax(logits)
    for m in range(1, 71):
        s = (5 * m) % 70
        assert torch.equal(rms_norm(x[s : s + m], w, 1e-5), full_norm[s : s + m]), m
        assert torch.equal(log_softmax(logits[s : s + m]), full_lsm[s : s + m]), m


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_padded_and_unpadded_batches_give_the_same_rows(dtype):
    """Rows computed inside a batch padded with zero rows, or with other rows, keep their bits."""
    from timlab.kernels import linear, log_softmax, rms_norm

    g = torch.Generator().manual_seed(4)
    x, w = randn(9, 48, g=g, dtype=dtype), randn(40, 48, g=g, dtype=dtype)
    nw = (1 + 0.1 * randn(48, g=g)).to(dtype)
    for padded in (torch.cat([x, torch.zeros_like(x[:7])]), torch.cat([randn(23, 48, g=g, dtype=dtype), x])):
        rows = slice(0, 9) if padded.shape[0] == 16 else slice(23, 32)
        assert torch.equal(linear(padded, w)[rows], linear(x, w))
        assert torch.equal(rms_norm(padded, nw, 1e-6)[rows], rms_norm(x, nw, 1e-6))
        assert torch.equal(log_softmax(padded.float())[rows], log_softmax(x.float()))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_one_decode_query_equals_its_row_of_the_trainer(dtype):
    """One query (a decode step) and chunks of queries vs all S queries (the trainer's forward)."""
    from timlab.kernels import fixed_length_attention

    q, k, v, allowed, scale = _attention_inputs(dtype)
    full = fixed_length_attention(q, k, v, allowed, scale)  # (B, H, S, D)
    # compiled: every single query (Triton's default specialization of M == 1 broke about half of
    # them in fp32 on an H100); interpreted: a sample, as each call costs milliseconds
    singles = [(t, 1) for t in range(40)] if ON_GPU else [(0, 1), (6, 1), (39, 1)]
    for t, m in singles + [(3, 5), (17, 23)]:
        part = fixed_length_attention(q[:, :, t : t + m], k, v, allowed[:, :, t : t + m], scale)
        assert torch.equal(part, full[:, :, t : t + m]), (t, m)
    one = fixed_length_attention(q[1:, :, 20:21], k[1:], v[1:], allowed[1:, :, 20:21], scale)  # batch of one
    assert torch.equal(one, full[1:, :, 20:21])


# ------------------------------------------------------------------------------ autograd
@needs_triton
def test_backward_goes_through_stock_kernels():
    from timlab.kernels import fixed_length_attention, linear, log_softmax, rms_norm
    from timlab.kernels.attention import attention_reference
    from timlab.kernels.rowwise import rms_norm_reference

    g = torch.Generator().manual_seed(5)
    x, w, b, nw = randn(6, 32, g=g), randn(24, 32, g=g), randn(24, g=g), 1 + 0.1 * randn(32, g=g)
    q, k, v, allowed, scale = _attention_inputs(torch.float32, S=16)

    def grads(lin, norm, lsm, att):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b, nw, q, k, v)]
        xx, ww, bb, nn, qq, kk, vv = leaves
        loss = lsm(lin(norm(xx, nn, 1e-6), ww, bb)).square().mean() + att(qq, kk, vv, allowed, scale).square().mean()
        return torch.autograd.grad(loss, leaves)

    ours = grads(linear, rms_norm, log_softmax, fixed_length_attention)
    stock = grads(F.linear, rms_norm_reference, lambda t: torch.log_softmax(t, -1), attention_reference)
    for a, s in zip(ours, stock):
        torch.testing.assert_close(a, s, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ the exact engine
@needs_triton
@pytest.mark.parametrize("loop", (False, True), ids=("host-loop", "device-loop-graphs"))
@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen3", torch.float32)],
                         ids=("llama-fp32", "llama-bf16", "qwen3-fp32"))
def test_exact_engine_bitwise_equals_trainer_through_the_kernels(arch, dtype, loop):
    """tests/test_engines.py's central claim, with every exact-path op on the Triton kernels; also
    through the device loop's graph step (captured as CUDA graphs on a GPU, eager here)."""
    from test_engines import EOS, PAD, ragged_prompts, tiny_model, trainer_logprobs

    from timlab.engines import build_engine
    from timlab.engines.device_loop import DeviceLoop
    from timlab.model.ops import kernel_backend

    model = tiny_model(arch, dtype).to(DEVICE)
    model.refresh_rope()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    if loop:
        engine.device_loop = DeviceLoop(sync_every=2, buckets=(2, 4), cuda_graphs=True)
    with kernel_backend("triton"):
        r = engine.generate(ragged_prompts(4), max_new_tokens=6,
                            generator=torch.Generator(device=DEVICE).manual_seed(3))
        logp = trainer_logprobs(model, r)
    m = r.response_mask
    assert len(set(r.lengths.tolist())) > 1  # rows end at different steps: compaction ran
    assert torch.equal(logp[m], r.logprobs[m]), float((logp - r.logprobs)[m].abs().max())
    # and the kernels compute the same model as the CPU path, to rounding
    stock = trainer_logprobs(model, r)
    assert float((stock - logp)[m].abs().max()) < (1e-4 if dtype == torch.float32 else 0.25)


# ------------------------------------------------------------------------------ devices and imports
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@needs_triton
def test_float64_is_refused_in_one_line():
    from timlab.kernels import fixed_length_attention, linear

    q, k, v, allowed, scale = _attention_inputs(torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16; got torch.float64"):
        fixed_length_attention(q, k, v, allowed, scale)
    with pytest.raises(ValueError, match="got torch.float64"):
        linear(q[0, 0], k[0, 0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_asking_for_cuda_without_it_is_a_one_line_error():
    with pytest.raises(UsageError, match="no CUDA GPU") as e:
        timlab.kernels.check_device("cuda")
    assert "\n" not in str(e.value)
    timlab.kernels.check_device("cpu")


def test_asking_for_cuda_without_triton_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timlab.kernels, "available", lambda: False)
    with pytest.raises(UsageError, match=r"timlab\[gpu\]") as e:
        timlab.kernels.check_device("cuda:0")
    assert "\n" not in str(e.value)


def test_import_timlab_does_not_import_triton():
    code = "import sys, timlab, timlab.model, timlab.engines, timlab.kernels; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
