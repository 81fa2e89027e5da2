"""The realistic injectors: fp8 (W8A8 e4m3), kv_cache (the cache's storage dtype) and stale (the
weights of k steps ago): hand-computed roundings, realized k3, composition, and the lag exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from timlab.config import MismatchSection
from timlab.engines import SamplingParams, build_engine
from timlab.errors import UsageError
from timlab.injectors import build_injector
from timlab.injectors.fp8 import fp8_quantize_dequantize
from timlab.injectors.kv_cache import store_as
from timlab.metrics import offpolicy_metrics
from timlab.model.forward import token_logprobs
from timlab.model.llama import CausalLM, MappedInputLinear, ModelConfig

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m.eval()


def injector(model, spec, magnitude=0.0, **kw):
    return build_injector(MismatchSection(injector=spec, magnitude=magnitude, **kw), model, eos_token_id=2,
                          pad_token_id=0)


def rollout(inj_or_engine, max_new_tokens=24):
    run = inj_or_engine.rollout if hasattr(inj_or_engine, "rollout") else inj_or_engine.generate
    return run(PROMPTS, max_new_tokens=max_new_tokens, sampling=SamplingParams(),
               generator=torch.Generator().manual_seed(0))


def k3(model, r) -> float:
    with torch.enable_grad():
        lp, _ = token_logprobs(model, r.tokens, r.key_valid)
    return offpolicy_metrics(lp.detach(), r.logprobs, r.response_mask.float())["k3_kl"]


# ------------------------------------------------------------------------------ fp8
def test_fp8_quantize_dequantize_by_hand():
    # per tensor: amax 448 -> scale 1, so each value is its e4m3 rounding (3 mantissa bits, ties
    # to even): 1.0625 -> 1.0 (tie), 1.07 -> 1.125, -17 -> -16 (tie), 0.3 -> 0.3125, 2^-10 -> 0 (tie)
    x = torch.tensor([[448.0, 1.0625, 1.07, -17.0], [0.3, 2.0**-10, 3 * 2.0**-10, 0.0]])
    want = torch.tensor([[448.0, 1.0, 1.125, -16.0], [0.3125, 0.0, 2.0**-8, 0.0]])
    assert torch.equal(fp8_quantize_dequantize(x, "per_tensor"), want)
    # per channel: the second row's own scale 4.48 / 448 = 0.01 keeps its small values (1.07 -> 1.125)
    y = torch.tensor([[448.0, 1.07], [4.48, 0.0107]])
    q = fp8_quantize_dequantize(y, "per_channel")
    assert torch.equal(q[0], torch.tensor([448.0, 1.125]))
    assert q[1].tolist() == pytest.approx([4.48, 0.01125], rel=1e-6)
    assert fp8_quantize_dequantize(y, "per_tensor")[1, 1] == 5 * 2.0**-9  # one scale: the subnormal grid (2^-9 apart)
    assert torch.equal(fp8_quantize_dequantize(torch.zeros(2, 3), "per_tensor"), torch.zeros(2, 3))
    assert fp8_quantize_dequantize(y.bfloat16(), "per_channel").dtype == torch.bfloat16


def test_fp8_rollout_weights_are_e4m3_and_the_rest_untouched(model):
    inj = injector(model, "fp8", scale_granularity="per_channel")
    rm = inj.rollout_model
    q = rm.model.layers[0].mlp.up_proj
    assert isinstance(q, MappedInputLinear)
    w = model.model.layers[0].mlp.up_proj.weight
    scale = w.abs().amax(dim=-1, keepdim=True) / 448.0  # (N, 1)
    on_grid = (q.weight / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.allclose(q.weight, on_grid, rtol=1e-6, atol=0) and not torch.equal(q.weight, w)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(dict(rm.named_parameters())[name], dict(model.named_parameters())[name])
    assert not any(isinstance(m, MappedInputLinear) for m in model.modules())  # the trainer's is plain


def test_fp8_realizes_a_mismatch_and_per_channel_is_finer(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    k_tensor = k3(model, rollout(injector(model, "fp8", scale_granularity="per_tensor")))
    k_channel = k3(model, rollout(injector(model, "fp8", scale_granularity="per_channel")))
    k_bf16 = k3(model, rollout(injector(model, "precision", dtype="bfloat16")))
    assert k_bf16 < k_channel < k_tensor  # 7 mantissa bits < 3 bits with fine scales < 3 bits with one scale
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp8_checks(model):
    with pytest.raises(UsageError, match="mismatch.scale_granularity 'per_row' for fp8; valid choices: per_tensor, per_channel"):
        injector(model, "fp8", scale_granularity="per_row")
    with pytest.raises(UsageError, match="part fp8 changes timlab's model code, which the rollout engine 'hf' does not run"):
        injector(model, "fp8+engine", engine="hf")


# ------------------------------------------------------------------------------ kv_cache
def test_store_as_by_hand():
    x = torch.tensor([1.0625, 500.0, -17.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 70000.0])
    assert store_as(x, torch.float8_e4m3fn).tolist() == [1.0, 448.0, -16.0, 1.0, 1.0, 448.0]  # saturates at 448
    assert store_as(x, torch.float8_e5m2).tolist() == [1.0, 512.0, -16.0, 1.0, 1.0, 57344.0]
    assert store_as(x, torch.bfloat16).tolist() == [1.0625, 500.0, -17.0, 1.0, 1.015625, 70144.0]  # ties to even
    assert store_as(x.bfloat16(), torch.float8_e4m3fn).dtype == torch.bfloat16


def test_kv_cache_k3_orders_with_the_storage_precision(model):
    ks = {d: k3(model, rollout(injector(model, "kv_cache", dtype=d))) for d in ("float16", "bfloat16", "fp8", "fp8_e5m2")}
    assert 0 < ks["float16"] < ks["bfloat16"] < ks["fp8"] < ks["fp8_e5m2"], ks


def test_kv_cache_in_the_trainers_own_dtype_is_no_mismatch(model):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    r = rollout(injector(bf16, "kv_cache", dtype="bfloat16"))
    assert k3(bf16, r) == 0.0
    assert torch.equal(r.logprobs, rollout(build_engine("exact", bf16, eos_token_id=2, pad_token_id=0)).logprobs)


def test_kv_cache_composes_and_checks(model):
    both = k3(model, rollout(injector(model, "kv_cache+fp8", dtype="fp8")))
    assert both > k3(model, rollout(injector(model, "kv_cache", dtype="fp8")))
    with pytest.raises(UsageError, match="mismatch.dtype 'int8' for kv_cache; valid choices: bfloat16, float16, fp8, fp8_e5m2"):
        injector(model, "kv_cache", dtype="int8")


def test_store_as_with_a_scale_by_hand():
    x = torch.tensor([1.0625, 0.01, -3.0, 0.3, 500.0])
    # scale 1.0 is the unscaled cache, bit for bit
    assert torch.equal(store_as(x, torch.float8_e4m3fn, 1.0), store_as(x, torch.float8_e4m3fn))
    # scale 2^6: x / 64 lands among e4m3's subnormals (step 2^-9) for the small values:
    # 0.01 / 64 = 1.56e-4 -> 0 (below half a step); 0.3 / 64 = 4.69e-3 -> 2 * 2^-9 = 3.91e-3 -> 0.25
    got = store_as(x, torch.float8_e4m3fn, 64.0).tolist()
    assert got == [1.0, 0.0, -3.0, 0.25, 512.0], got  # 500 / 64 = 7.81 -> 8 (e4m3 steps of 0.5 there)
    # scale 2^-4: values over 448 / 16 = 28 saturate
    assert store_as(x, torch.float8_e4m3fn, 1 / 16).tolist()[-1] == 28.0


def test_kv_cache_scale_grows_the_mismatch_and_is_fp8_only(model):
    base = k3(model, rollout(injector(model, "kv_cache", dtype="fp8")))
    same = k3(model, rollout(injector(model, "kv_cache", magnitude=0.0, dtype="fp8")))
    assert same == base
    coarse = k3(model, rollout(injector(model, "kv_cache", magnitude=8.0, dtype="fp8")))
    assert coarse > 3 * base, (base, coarse)
    with pytest.raises(UsageError, match="only an fp8 cache has; mismatch.dtype=bfloat16 .valid with a magnitude: fp8, fp8_e5m2."):
        injector(model, "kv_cache", magnitude=2.0, dtype="bfloat16")


# ------------------------------------------------------------------------------ stale
def _perturbed(model, seed):
    """The trainer's weights after an 'update': every parameter moved by a seeded 1e-2 step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))


def _exact_with(weights: dict, model) -> object:
    m = copy.deepcopy(model)
    m.load_state_dict(weights)
    return build_engine("exact", m, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize("sets, lags, ring", [
    ({"magnitude": 1.0}, [1, 1, 1, 1, 1], [3, 4]),  # the ring: the last k + 1 versions
    ({"magnitude": 2.0}, [2, 2, 2, 2, 2], [2, 3, 4]),
    # a ramp 3 -> 1 over 4 steps: 3, 2.5, 2, 1.5, 1, rounded half up; the ring reaches back 3
    ({"magnitude": 3.0, "schedule": "linear", "magnitude_end": 1.0, "ramp_steps": 4}, [3, 3, 2, 2, 1], [1, 2, 3, 4]),
])
def test_stale_rolls_out_with_the_weights_of_k_steps_ago(model, sets, lags, ring):
    trainer = copy.deepcopy(model)
    inj = injector(trainer, "stale", **sets)
    history = []  # the trainer's weights at the start of each step
    for step, lag in zip(range(1, 6), lags):
        history.append({k: v.clone() for k, v in trainer.state_dict().items()})
        inj.begin_step(step)
        r = rollout(inj)
        want = rollout(_exact_with(history[max(step - 1 - lag, 0)], model))  # the first k steps: the start
        assert torch.equal(r.tokens, want.tokens) and torch.equal(r.logprobs, want.logprobs), step
        assert (k3(trainer, r) == 0.0) == (step == 1)
        _perturbed(trainer, step)
        inj.refresh()  # as the trainer does after each update
    assert sorted(inj.injectors[0].versions) == ring


def test_stale_composes_as_the_source_of_the_other_parts(model):
    """stale+precision at step 2 is a bf16 copy of step 1's weights, bit for bit."""
    trainer = copy.deepcopy(model)
    start = copy.deepcopy(model)
    inj = injector(trainer, "stale+precision", 1.0, dtype="bfloat16")
    inj.begin_step(1)
    _perturbed(trainer, 0)
    inj.refresh()
    inj.begin_step(2)
    want = injector(start, "precision", dtype="bfloat16")
    a, b = rollout(inj), rollout(want)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def test_stale_state_round_trips(model):
    trainer = copy.deepcopy(model)
    inj = injector(trainer, "stale", 2.0)
    for step in (1, 2, 3):
        inj.begin_step(step)
        _perturbed(trainer, step)
        inj.refresh()
    state = copy.deepcopy(inj.state_dict())
    assert sorted(state["stale"]["versions"]) == [0, 1, 2] and state["stale"]["loaded"] == 0
    fresh = injector(trainer, "stale", 2.0)
    fresh.load_state_dict(state)
    fresh.refresh()
    for i in (inj, fresh):
        i.begin_step(4)
    a, b = rollout(inj), rollout(fresh)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("sets, key", [
    ({"magnitude": 0.0}, "mismatch.magnitude"), ({"magnitude": 1.5}, "mismatch.magnitude"),
    ({"magnitude": 1.0, "schedule": "linear", "ramp_steps": 3, "magnitude_end": 2.5}, "mismatch.magnitude_end"),
])
def test_stale_lag_must_be_an_integer_of_at_least_one(model, sets, key):
    with pytest.raises(UsageError, match=f"{key} for stale is the lag k in training steps: an integer >= 1, got"):
        injector(model, "stale", **sets)
