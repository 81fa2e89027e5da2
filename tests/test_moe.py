"""Qwen3-MoE: parity with transformers, HF folders both ways, and exact rollouts through routing.

Parity is against transformers' own Qwen3MoeForCausalLM (eager attention, fp32, max |logit diff|
<= 1e-5) on folders it wrote, with exact ties and near-ties in the router. Exactness on MoE
models (the exact engine's log-probs equal the trainer's forward bit for bit: fp32, bf16, ragged
batches, rows finishing at different steps, the packed trainer forward, the randomized harness)
is checked by tests/test_engines.py, whose ARCHS include qwen3_moe; here: what it rests on (a
token's MoE output does not depend on its batch), 1 and 2 threads, the routing record, routing
mismatch measured (probe, trainer), injected (router_precision) and removed (router replay).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from test_engines import EOS, PAD, V, _make_eos_likely, ragged_prompts, trainer_logprobs
from timlab.engines import build_engine
from timlab.errors import UsageError
from timlab.model.forward import full_step, positions_from_valid, token_logprobs
from timlab.model.hf_io import load_model, save_model
from timlab.model.llama import CausalLM, ModelConfig, random_init_
from timlab.model.moe import Routing, SparseMoeBlock

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def hf_moe(*, norm_topk_prob: bool = False, sparse_step: int = 1, mlp_only: tuple = (1,), experts: int = 8,
           top_k: int = 2, seed: int = 0):
    """transformers' Qwen3MoeForCausalLM, 3 layers (layer 1 dense by default), weights std 0.2."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=40, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only),
        max_position_embeddings=128, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    random_init_(hf, g, std=0.2)
    return hf.eval()


def ragged_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, key_valid (B=4, S=24), left padding of 0, 5, 11 and 23 columns."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 40, (4, 24), generator=g)
    key_valid = torch.ones_like(tokens, dtype=torch.bool)
    for b, pad in enumerate((0, 5, 11, 23)):
        key_valid[b, :pad] = False
        tokens[b, :pad] = PAD
    return tokens, key_valid


def hf_logits(hf, tokens, key_valid) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=tokens, attention_mask=key_valid.long(),
                  position_ids=positions_from_valid(key_valid)).logits.float()


def timlab_logits(model: CausalLM, tokens, key_valid, routing: Routing | None = None) -> torch.Tensor:
    step = full_step(key_valid)
    step.routing = routing
    with torch.no_grad():
        return model(tokens, step)


def hf_router_choices(hf, tokens, key_valid) -> dict[int, torch.Tensor]:
    """The experts HF's routers chose per sparse layer, (B, S, k)."""
    chosen, handles = {}, []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            def hook(module, args, out, i=i):
                chosen[i] = out[2].view(*tokens.shape, -1)
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    hf_logits(hf, tokens, key_valid)
    for h in handles:
        h.remove()
    return chosen


# ------------------------------------------------------------------------------ HF parity
PARITY_CASES = {
    "top2-mlp-only-1": dict(),
    "norm-topk": dict(norm_topk_prob=True),
    "sparse-step-2": dict(sparse_step=2, mlp_only=()),
    "top4-of-6": dict(experts=6, top_k=4, mlp_only=(0,)),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_hf_folder_loads_with_same_logits_and_routing(tmp_path, case):
    hf = hf_moe(**PARITY_CASES[case])
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and cfg.is_moe
    assert [layer.sparse for layer in model.model.layers] == [hasattr(lay.mlp, "gate") for lay in hf.model.layers]
    tokens, key_valid = ragged_batch()
    routing = Routing()
    ref, got = hf_logits(hf, tokens, key_valid), timlab_logits(model, tokens, key_valid, routing)
    assert float(ref.abs().max()) > 1.0
    assert float((ref[key_valid] - got[key_valid]).abs().max()) <= TOL
    hf_chosen = hf_router_choices(hf, tokens, key_valid)
    assert sorted(routing.chosen) == sorted(hf_chosen)
    for i, experts in hf_chosen.items():  # same experts in the same rank order at every real token
        assert torch.equal(routing.chosen[i][key_valid], experts[key_valid]), i


def test_timlab_folder_loads_in_transformers_and_back(tmp_path):
    hf_moe(norm_topk_prob=True).save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    save_model(model, tmp_path / "timlab")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "timlab", attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.config.num_experts, hf.config.num_experts_per_tok, hf.config.norm_topk_prob) == (8, 2, True)
    assert hf.config.mlp_only_layers == [1]
    tokens, key_valid = ragged_batch(seed=1)
    got = timlab_logits(model, tokens, key_valid)
    assert float((hf_logits(hf, tokens, key_valid)[key_valid] - got[key_valid]).abs().max()) <= TOL
    assert torch.equal(timlab_logits(load_model(tmp_path / "timlab"), tokens, key_valid), got)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I))
    saved as it is loads with the same logits."""
    hf = hf_moe()
    hf.save_pretrained(tmp_path / "ref")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    tokens, key_valid = ragged_batch()
    a = timlab_logits(load_model(tmp_path / "fused"), tokens, key_valid)
    assert torch.equal(a, timlab_logits(load_model(tmp_path / "ref"), tokens, key_valid))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_ties_and_near_ties_match_transformers(tmp_path, norm_topk_prob):
    """Exact ties (experts 1 and 2, 5 and 6 have equal router rows, so equal probabilities at every
    token) and near-ties (expert 3's row = expert 0's + 1e-3 noise) while every expert's MLP
    differs: a tie broken the other way would move the logits by O(1)."""
    hf = hf_moe(norm_topk_prob=norm_topk_prob)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w[2], w[6] = w[1], w[5]
                w[3] = w[0] + 1e-3 * torch.randn(w.shape[1], generator=g)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    tokens, key_valid = ragged_batch(seed=3)
    routing = Routing()
    got = timlab_logits(model, tokens, key_valid, routing)
    assert float((hf_logits(hf, tokens, key_valid)[key_valid] - got[key_valid]).abs().max()) <= TOL
    hf_chosen = hf_router_choices(hf, tokens, key_valid)
    ties = 0
    for i, experts in hf_chosen.items():
        assert torch.equal(routing.chosen[i][key_valid], experts[key_valid])
        sets = experts[key_valid]
        ties += int(((sets == 1) | (sets == 2) | (sets == 5) | (sets == 6)).any(-1).sum())
    assert ties >= 20  # the tied experts are chosen often: the ties were exercised


def test_moe_config_errors():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    with pytest.raises(UsageError, match="num_experts=4 needs model_type='qwen3_moe'"):
        ModelConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)
    with pytest.raises(UsageError, match="num_experts_per_tok must be in 1..num_experts=4, got 5"):
        ModelConfig(**base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=4)
    with pytest.raises(UsageError, match="moe_intermediate_size must be >= 1"):
        ModelConfig(**base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2)


_GOOD_MOE = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 1,
             "pad_token_id": 0, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}


@pytest.mark.parametrize("change, needle", [
    ({"num_experts": 10**9}, "num_experts must be an integer in [1, 4096], got 1000000000"),  # finding 8
    ({"num_local_experts": 10**9, "num_experts": None}, "num_experts is null"),
    ({"num_experts": "abc"}, "num_experts must be an integer in [1, 4096], got 'str'"),  # finding 10
    ({"num_experts": None}, "num_experts is null; give a value or leave the field out"),
    ({"mlp_only_layers": "ab"}, "mlp_only_layers must be a list of layer indices in [0, 2], got 'ab'"),
    ({"mlp_only_layers": 5}, "mlp_only_layers must be a list of layer indices in [0, 2], got 5"),
    ({"mlp_only_layers": [1, 3]}, "mlp_only_layers must be a list of layer indices in [0, 2], got [1, 3]"),
    ({"mlp_only_layers": [True]}, "mlp_only_layers must be a list of layer indices"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false, got 'false'"),  # finding 15
    ({"num_experts": 4.9}, "num_experts must be an integer in [1, 4096], got 4.9"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok must be an integer in [1, 4], got 5"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer in [1, 4], got 0"),
    ({"moe_intermediate_size": 10**9}, "moe_intermediate_size must be an integer in [1, 1048576]"),
    ({"moe_intermediate_size": -8}, "moe_intermediate_size must be an integer in [1, 1048576], got -8"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer in [1, 1024], got 0"),
    ({"decoder_sparse_step": "1"}, "decoder_sparse_step must be an integer"),
])
def test_42_moe_config_json_fields_are_type_and_range_checked(change, needle):
    """Issue 42, findings 8, 10 and 15: the MoE fields of config.json were passed through int() and
    bool() (1e9 experts hung the load, "abc" and null were tracebacks, "false" became True, 4.9 became 4)."""
    from timlab.model.hf_io import ModelLoadError, config_from_hf

    with pytest.raises(ModelLoadError) as e:
        config_from_hf({**_GOOD_MOE, **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_42_moe_config_json_good_values_and_hf_defaults():
    from timlab.model.hf_io import config_from_hf

    cfg = config_from_hf(_GOOD_MOE)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 8)
    assert cfg.norm_topk_prob is True and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == (1,)
    legacy = {k: v for k, v in _GOOD_MOE.items() if k not in ("num_experts", "mlp_only_layers", "norm_topk_prob")}
    cfg = config_from_hf({**legacy, "num_local_experts": 6, "mlp_only_layers": None})
    assert (cfg.num_experts, cfg.mlp_only_layers, cfg.norm_topk_prob) == (6, (), False)
    bare = {k: v for k, v in _GOOD_MOE.items() if k not in ("num_experts", "num_experts_per_tok",
                                                             "moe_intermediate_size", "decoder_sparse_step")}
    cfg = config_from_hf(bare)  # transformers' Qwen3MoeConfig defaults
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.decoder_sparse_step) == (128, 8, 768, 1)


# ------------------------------------------------------------------------------ exactness
def tiny_moe(dtype=torch.float32, *, seed: int = 0, hidden: int = 32, expert_width: int = 16, experts: int = 8,
             top_k: int = 2, eos_prob: float = 0.08) -> CausalLM:
    """A 2-layer random Qwen3-MoE (8 experts, top-2, GQA), weights std 0.3, EOS made likely."""
    cfg = ModelConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=expert_width, eos_token_id=EOS, pad_token_id=PAD, max_position_embeddings=256)
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        random_init_(model, g)
        _make_eos_likely(model, eos_prob, g)
    model.refresh_rope()
    return model.to(dtype)


def test_moe_block_bits_do_not_depend_on_the_batch():
    """A token's MoE output (exact mode) is the same float alone, in any subset, in any order."""
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 16, num_experts=8, top_k=2, norm_topk_prob=False, layer_idx=0)
    x = torch.randn(40, 32)
    with torch.no_grad():
        full = block(x, "exact")
        for rows in (torch.tensor([5]), torch.arange(3), torch.randperm(40)[:17], torch.randperm(40)):
            assert torch.equal(block(x[rows], "exact"), full[rows])


def test_moe_rollouts_same_bits_on_1_and_2_threads():
    """Wide enough (hidden 512, experts of width 512) that the exact path's fp32 GEMMs split across
    threads (bf16 GEMMs are never split: ``timlab.model.cpu_gemm``)."""
    model = tiny_moe(hidden=512, expert_width=512, experts=4, eos_prob=0.05)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = ragged_prompts(20)
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            r = engine.generate(prompts, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
            results.append((r, trainer_logprobs(model, r)))
    finally:
        torch.set_num_threads(old)
    (r1, t1), (r2, t2) = results
    assert torch.equal(r1.tokens, r2.tokens) and torch.equal(r1.logprobs, r2.logprobs)
    m = r1.response_mask
    assert torch.equal(t1[m], r1.logprobs[m]) and torch.equal(t2[m], r2.logprobs[m])


# ------------------------------------------------------------------------------ routing mismatch, probed
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from test_probe import CHARS, VOCAB
    from timlab.tokenizer import save_char_tokenizer

    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    model = CausalLM(cfg)
    random_init_(model, g)
    path = tmp_path_factory.mktemp("moe")
    save_char_tokenizer(CHARS, path)
    save_model(model, path)
    (path / "prompts.txt").write_text("12+34=\nabc\n9-3=\n a b \n7\n")
    return path


def moe_probe(tmp_path, folder, *args) -> dict:
    import json

    from timlab.cli import main

    out = tmp_path / "probe.json"
    assert main(["probe", "--model", str(folder), "--prompts", str(folder / "prompts.txt"), "--max-new-tokens", "16",
                 "--samples-per-prompt", "3", "--dtype", "bfloat16", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_probe_exact_rollout_has_no_router_flips(tmp_path, moe_folder, capsys):
    res = moe_probe(tmp_path, moe_folder, "--rollout", "exact", "--score", "trainer", "--attribute")
    assert res["max_abs_diff"] == 0.0 and res["first_divergent_op"] is None
    assert res["router_flip_frac"] == 0.0 and res["router_flip_frac_any_layer"] == 0.0
    assert res["router_flip_frac_by_layer"] == {"0": 0.0, "1": 0.0}
    assert res["router_flipped_tokens"] == 0 and res["router_unflipped_tokens"] == res["num_tokens"]
    assert not any(op["name"].endswith("router_experts") for op in res["ops"])
    assert "router flips (top-k set differs): 0 of" in capsys.readouterr().out


def test_probe_bf16_fast_rollout_flips_routers_and_flips_carry_the_mismatch(tmp_path, moe_folder):
    """bf16 production path vs the trainer: some positions change experts, and the tokens they
    produce carry a far larger |r| than the rest (measured: 5.7% of positions, 0.16 vs 0.013)."""
    res = moe_probe(tmp_path, moe_folder, "--rollout", "fast", "--score", "trainer")
    assert 0.01 < res["router_flip_frac_any_layer"] < 0.5
    assert res["router_flip_frac"] == pytest.approx(sum(res["router_flip_frac_by_layer"].values()) / 2)
    assert res["router_flipped_tokens"] + res["router_unflipped_tokens"] == res["num_tokens"]
    assert res["abs_diff_mean_router_flipped"] > 3 * res["abs_diff_mean_router_unflipped"] > 0


# ------------------------------------------------------------------------------ injected, replayed, trained
def test_rollout_records_the_experts_the_trainer_computes():
    """The exact engine's record (prefill, decode, finished rows dropped from the batch, shared
    prefill) equals the trainer's own router choices wherever the rollout computed a column."""
    model = tiny_moe()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = ragged_prompts(6) * 3  # repeated prompts: the shared prefill's rows are copied back
    r = engine.generate(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(0), record_routing=True)
    assert r.experts.shape == (2, 18, r.tokens.shape[1], 2)
    routing = Routing()
    logp, _ = token_logprobs(model, r.tokens, r.key_valid, routing=routing)
    assert torch.equal(logp[r.response_mask], r.logprobs[r.response_mask])
    recorded = r.experts[..., 0] >= 0  # (L, B, S)
    pred = torch.zeros_like(r.response_mask)
    pred[:, :-1] = r.response_mask[:, 1:]
    assert recorded[:, pred].all()  # every position that produced a response token is in the record
    own = torch.stack([routing.chosen[0], routing.chosen[1]])
    assert torch.equal(own[recorded], r.experts[recorded])
    # replaying the record changes nothing when the rollout was exact
    again, _ = token_logprobs(model, r.tokens, r.key_valid, routing=Routing(forced={0: r.experts[0], 1: r.experts[1]}))
    assert torch.equal(again, logp)
    with pytest.raises(UsageError, match="cannot record expert routing"):
        build_engine("exact", tiny_model_dense(), eos_token_id=EOS, pad_token_id=PAD).generate(
            [[5]], max_new_tokens=2, record_routing=True)


def tiny_model_dense():
    from test_engines import tiny_model

    return tiny_model("qwen3")


def injected(model, injector: str, dtype: str, replay: bool) -> dict:
    """Realized mismatch of an injector on ``model`` with the trainer's routers free or replayed."""
    from timlab.config import MismatchSection
    from timlab.engines import SamplingParams
    from timlab.injectors import build_injector
    from timlab.metrics import offpolicy_metrics, routing_metrics

    sec = MismatchSection(injector=injector, dtype=dtype)
    inj = build_injector(sec, model, eos_token_id=EOS, pad_token_id=PAD)
    r = inj.rollout(ragged_prompts(32), max_new_tokens=24, sampling=SamplingParams(),
                    generator=torch.Generator().manual_seed(0), record_routing=True)
    routing = Routing(forced={0: r.experts[0], 1: r.experts[1]} if replay else {})
    with torch.enable_grad():
        logp, _ = token_logprobs(model, r.tokens, r.key_valid, routing=routing)
    logp, m = logp.detach(), r.response_mask
    pred = torch.zeros_like(m)
    pred[:, :-1] = m[:, 1:]
    abs_diff = torch.zeros_like(logp)
    abs_diff[:, :-1] = (logp - r.logprobs).abs()[:, 1:]
    out = routing_metrics(r.experts, torch.stack([routing.chosen[0], routing.chosen[1]]), pred, abs_diff)
    out["k3"] = offpolicy_metrics(logp, r.logprobs, m.float())["k3_kl"]
    out["max_abs_diff"] = float((logp - r.logprobs)[m].abs().max())
    return out


def test_router_precision_injects_flips_and_router_replay_removes_their_mismatch():
    """Measured on this 8-expert top-2 model (32 ragged prompts, 24 new tokens): router logits in
    bf16 flip 0.8% of positions, whose tokens carry mean |r| 0.22 (0.0025 elsewhere), k3 2.8e-4;
    replaying the rollout's experts brings k3 to 5e-6 and max |r| from 0.38 to 0.014 (what
    remains: the router weights). A whole bf16 rollout: k3 1.3e-3, replayed 3.1e-4."""
    model = tiny_moe(eos_prob=0.02)
    free = injected(model, "router_precision", "bfloat16", replay=False)
    replayed = injected(model, "router_precision", "bfloat16", replay=True)
    assert free["mismatch/router_flip_frac_any_layer"] > 0.002
    assert free["mismatch/abs_diff_mean_router_flipped"] > 20 * free["mismatch/abs_diff_mean_router_unflipped"]
    assert free["k3"] > 1e-4
    assert replayed["k3"] < free["k3"] / 10
    assert replayed["max_abs_diff"] < free["max_abs_diff"] / 5
    assert replayed["mismatch/abs_diff_mean_router_flipped"] < 3 * replayed["mismatch/abs_diff_mean_router_unflipped"]
    # a whole bf16 rollout (precision): k3 1.3e-3 with 1.7% of positions flipped; replay leaves 3e-4
    bf16, bf16_replayed = (injected(model, "precision", "bfloat16", replay=r) for r in (False, True))
    assert bf16["mismatch/router_flip_frac_any_layer"] > 0.005
    assert bf16_replayed["k3"] < bf16["k3"] / 2


def test_router_precision_needs_an_moe_model_and_a_low_precision_dtype():
    from timlab.config import MismatchSection
    from timlab.injectors import build_injector

    def build(model, dtype):
        sec = MismatchSection(injector="router_precision", dtype=dtype)
        return build_injector(sec, model, eos_token_id=EOS, pad_token_id=PAD)

    with pytest.raises(UsageError, match="router_precision needs a mixture-of-experts model"):
        build(tiny_model_dense(), "bfloat16")
    with pytest.raises(UsageError, match="mismatch.dtype 'float32' for router_precision; valid choices: bfloat16, float16"):
        build(tiny_moe(), "float32")
    model = tiny_moe()
    build(model, "bfloat16")
    assert all(layer.mlp.router_dtype is None for layer in model.model.layers)  # the trainer's model untouched


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    """A random Qwen3-MoE folder with the reverse task's tokenizer (RL starts from it)."""
    from timlab.tasks import TASKS
    from timlab.tokenizer import load_tokenizer, save_char_tokenizer

    path = tmp_path_factory.mktemp("moe_policy")
    save_char_tokenizer(TASKS.get("reverse")().alphabet, path)
    tok = load_tokenizer(path)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        max_position_embeddings=64)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
    save_model(model, path)
    return path


@pytest.mark.parametrize("injector, replay", [("none", False), ("none", True), ("router_precision", False),
                                              ("router_precision", True)])
def test_training_logs_router_flips_and_replays(tmp_path, moe_policy, injector, replay):
    import json

    import pandas as pd

    from timlab.config import resolve
    from timlab.trainer.run import train

    cfg = resolve(preset="smoke", overrides=[
        f"model.path={moe_policy}", "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2",
        f"mismatch.injector={injector}", f"correction.router_replay={str(replay).lower()}",
    ])
    train(cfg, tmp_path / "run")
    m = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    m = m[m["step"] >= 1]  # the RL steps (step 0: the starting evaluation)
    flips = m["mismatch/router_flip_frac"]
    assert len(m) == 2 and flips.notna().all()
    if injector == "none":  # exact rollouts (the zero-mismatch guard is on): no flip, no mismatch
        assert (flips == 0).all() and (m["mismatch/max_abs_diff"] == 0).all()
    else:
        assert (m["mismatch/max_abs_diff"] > 0).all()
    from test_metric_names import documented

    routed = {c for c in m.columns if "router" in c}
    assert routed == {"mismatch/router_flip_frac", "mismatch/router_flip_frac_any_layer",
                      "mismatch/abs_diff_mean_router_flipped", "mismatch/abs_diff_mean_router_unflipped"}
    assert routed <= documented()
    dists = [json.loads(line) for line in (tmp_path / "run" / "distributions.jsonl").read_text().splitlines()]
    assert set(dists[0]["router_flip_frac_by_layer"]) == {"0", "1"}


def test_hf_engine_and_hf_score_path_run_moe_models(tmp_path, moe_folder):
    """The hf engine copies timlab's per-expert weights into transformers' fused layout: its
    rollouts score close to the trainer in fp32 (no router flip at fp32 noise here)."""
    res = moe_probe(tmp_path, moe_folder, "--rollout", "hf", "--score", "trainer", "--dtype", "float32")
    assert 0 < res["max_abs_diff"] < 1e-4
    res = moe_probe(tmp_path, moe_folder, "--rollout", "exact", "--score", "hf", "--dtype", "float32")
    assert 0 < res["max_abs_diff"] < 1e-4 and "router_flip_frac" not in res


def test_surge_moe_preset_builds_an_moe_warm_start_and_logs_routing(tmp_path):
    """The MoE surge testbed end to end at a tiny budget: its warm start is a Qwen3-MoE with the
    preset's experts (built like the dense one, cached under its own key), the dense surge warm
    start keeps its key, and an exact 2-step run logs zero routing flips."""
    import json

    import pandas as pd

    from timlab.config import resolve
    from timlab.trainer.pretrain import warm_start_dir, warm_start_key
    from timlab.trainer.run import train

    cfg = resolve(preset="surge_moe")
    m = cfg.model
    assert (m.model_type, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == ("qwen3_moe", 8, 2, 96)
    dense = resolve(preset="surge").model
    # the same active MLP weights per token as the dense surge policy
    assert m.num_experts_per_tok * m.moe_intermediate_size == dense.intermediate_size
    assert warm_start_key(resolve(preset="surge")) == "b1c93a747d88"  # unchanged by the MoE fields
    assert warm_start_key(cfg) != warm_start_key(resolve(preset="surge_moe", overrides=["model.num_experts=4"]))

    cfg = resolve(preset="surge_moe", overrides=[
        "model.hidden_size=32", "model.num_layers=1", "model.moe_intermediate_size=16", "model.pretrain_steps=20",
        "task.kwargs.max_digits=2", "task.n_train=300", "task.n_val=16", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=16", "run.steps=2", "run.eval_every=2", "run.progress=false"])
    train(cfg, tmp_path / "run")
    config = json.loads((warm_start_dir(cfg) / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    assert config["moe_intermediate_size"] == 16 and config["norm_topk_prob"] is True
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").iloc[1:]
    assert len(df) == 2 and (df["mismatch/router_flip_frac"] == 0).all()
    assert (df["mismatch/frac_bitwise_equal"] == 1.0).all() and (df["rollout_corr/k3_kl"] == 0.0).all()


def test_moe_model_settings_errors():
    from timlab.config import check_warm_start, resolve
    from timlab.tasks import build_task

    for overrides, message in [
        (["model.model_type=qwen3_moe"], "model.model_type='qwen3_moe' needs model.num_experts >= 1"),
        (["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=8"],
         "model.num_experts=8 needs model.model_type='qwen3_moe', got 'llama'"),
        (["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=5"],
         r"model.num_experts_per_tok must be in 1..model.num_experts=4, got 5"),
        (["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2"],
         "model.moe_intermediate_size must be >= 1, got 0"),
    ]:
        cfg = resolve(preset="smoke", overrides=overrides)
        with pytest.raises(UsageError, match=message):
            check_warm_start(cfg, build_task(cfg))
