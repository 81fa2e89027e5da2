"""timlab's model against transformers: folder round trips, logit parity, load errors, the hf engine.

Parity is checked against HF's *eager* attention in fp32 (max |logit diff| <= 1e-5) for Llama,
Qwen2 and Qwen3 tiny random models with GQA, tied and untied heads, Llama attention bias, and
weights re-initialized large enough (std 0.2) that the logits are not tiny.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.model.forward import full_step, positions_from_valid, token_logprobs  # noqa: E402
from timlab.model.hf_io import ModelLoadError, load_model, save_model  # noqa: E402
from timlab.model.llama import ARCHITECTURES, CausalLM, ModelConfig, random_init_  # noqa: E402

V, EOS, PAD = 40, 2, 0
TOL = 1e-5

CASES = [  # (model_type, tie_word_embeddings, attention_bias)
    ("llama", False, True),
    ("llama", True, False),
    ("qwen2", False, False),
    ("qwen2", True, False),
    ("qwen3", False, False),
    ("qwen3", True, False),
]
CASE_IDS = [f"{t}-{'tied' if tied else 'untied'}{'-bias' if bias else ''}" for t, tied, bias in CASES]


def hf_config(model_type: str, tied: bool, bias: bool):
    kwargs = dict(
        vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
    )
    if model_type == "llama":
        kwargs["attention_bias"] = bias
    if model_type == "qwen3":
        kwargs["head_dim"] = 16  # Qwen3 takes head_dim explicitly (here 48 / 6 would be 8)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def reinit_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights with std 0.2 (norm weights 1 + 0.1 noise): logits of order 1-10, not ~0."""
    g = torch.Generator().manual_seed(seed)
    random_init_(model, g, std=0.2)


def hf_model(model_type: str, tied: bool, bias: bool, attn: str = "eager"):
    m = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, tied, bias), attn_implementation=attn)
    reinit_(m)
    return m.eval()


def ragged_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, key_valid (B=4, S=24), left padding of 0, 5, 11 and 23 columns."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (4, 24), generator=g)
    key_valid = torch.ones_like(tokens, dtype=torch.bool)
    for b, pad in enumerate((0, 5, 11, 23)):
        key_valid[b, :pad] = False
        tokens[b, :pad] = PAD
    return tokens, key_valid


def hf_logits(hf, tokens: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf(input_ids=tokens, attention_mask=key_valid.long(), position_ids=positions_from_valid(key_valid))
    return out.logits.float()


def timlab_logits(model: CausalLM, tokens: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, full_step(key_valid))


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_hf_folder_loads_in_timlab_with_same_logits(tmp_path, case):
    hf = hf_model(*case)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.model_type == case[0]
    assert model.config.tie_word_embeddings == case[1]
    tokens, key_valid = ragged_batch()
    ref, got = hf_logits(hf, tokens, key_valid), timlab_logits(model, tokens, key_valid)
    assert float(ref.abs().max()) > 1.0  # the check is not trivially passed by tiny logits
    v = key_valid  # left-padding query rows are garbage in both; compare real positions
    assert float((ref[v] - got[v]).abs().max()) <= TOL
    # the unpadded row (no attention_mask subtleties at all) too, through HF's default positions
    with torch.no_grad():
        plain = hf(input_ids=tokens[:1]).logits.float()
    assert float((plain[0] - got[0]).abs().max()) <= TOL


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_timlab_folder_loads_in_transformers(tmp_path, case):
    model = load_model(_saved_hf(tmp_path / "hf", case))  # a timlab model with non-trivial weights
    save_model(model, tmp_path / "timlab")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "timlab", attn_implementation="eager").eval()
    assert type(hf).__name__ == ARCHITECTURES[case[0]]
    assert hf.config.tie_word_embeddings == case[1]
    tokens, key_valid = ragged_batch(seed=1)
    ref, got = hf_logits(hf, tokens, key_valid), timlab_logits(model, tokens, key_valid)
    assert float((ref[key_valid] - got[key_valid]).abs().max()) <= TOL
    # and the saved folder reloads in timlab bit for bit
    again = load_model(tmp_path / "timlab")
    assert torch.equal(timlab_logits(again, tokens, key_valid), got)


def _saved_hf(path, case):
    hf_model(*case).save_pretrained(path)
    return path


# ------------------------------------------------------------------------------ RoPE scaling
ROPE_SCALINGS = {  # small context numbers so that every branch of each scaling acts within 24 positions
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}
ROPE_ARCHS = ("llama", "qwen2", "qwen3")


def hf_rope_model(model_type: str, scaling: dict):
    config = hf_config(model_type, False, False)
    config.rope_parameters = {**scaling, "rope_theta": 10000.0}
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    reinit_(m)
    return m.eval()


@pytest.mark.parametrize("model_type", ROPE_ARCHS)
@pytest.mark.parametrize("rope", ROPE_SCALINGS)
def test_rope_scaled_hf_folder_loads_with_same_logits(tmp_path, model_type, rope):
    hf = hf_rope_model(model_type, ROPE_SCALINGS[rope])
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    assert model.config.rope_type == rope
    tokens, key_valid = ragged_batch()
    # the RoPE tables equal transformers' cos and sin bit for bit
    pos = positions_from_valid(key_valid)
    cos_hf, sin_hf = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = model.rope(pos.device, int(pos.max()) + 1)
    assert torch.equal(cos[pos], cos_hf) and torch.equal(sin[pos], sin_hf)
    ref, got = hf_logits(hf, tokens, key_valid), timlab_logits(model, tokens, key_valid)
    assert float((ref[key_valid] - got[key_valid]).abs().max()) <= TOL
    # a folder timlab writes carries the scaling: transformers reads it back to the same logits
    save_model(model, tmp_path / "timlab")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "timlab", attn_implementation="eager").eval()
    assert float((hf_logits(again, tokens, key_valid) - got)[key_valid].abs().max()) <= TOL
    reloaded = load_model(tmp_path / "timlab").config
    assert (reloaded.rope_theta, reloaded.rope_scaling) == (model.config.rope_theta, model.config.rope_scaling)


def test_rope_scaling_changes_the_logits(tmp_path):
    """The scaled cases above are not the default RoPE in disguise (dynamic is, within context)."""
    tokens, key_valid = ragged_batch()
    base = hf_model("llama", False, False)
    for rope, scaling in ROPE_SCALINGS.items():
        hf = hf_rope_model("llama", scaling)
        diff = float((hf_logits(hf, tokens, key_valid) - hf_logits(base, tokens, key_valid))[key_valid].abs().max())
        assert (diff == 0.0) == (rope == "dynamic"), (rope, diff)


@pytest.mark.parametrize("rope", ROPE_SCALINGS)
def test_rope_scaled_exact_engine_bitwise_equals_trainer(tmp_path, rope):
    hf_rope_model("llama", ROPE_SCALINGS[rope]).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    r = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts(), max_new_tokens=16, generator=torch.Generator().manual_seed(0))
    m = r.response_mask
    assert torch.equal(_trainer_logp(model, r)[m], r.logprobs[m])


def test_dynamic_rope_past_the_context_is_refused(tmp_path):
    hf_rope_model("llama", ROPE_SCALINGS["dynamic"]).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    tokens = torch.randint(3, V, (1, 130), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="dynamic RoPE scaling past max_position_embeddings=128"):
        timlab_logits(model, tokens, torch.ones_like(tokens, dtype=torch.bool))


def test_llama_3_2_config_as_published_loads(tmp_path):
    """Llama-3.2-1B's config.json with its sizes shrunk and everything else as published."""
    published = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
    }
    small = {**published, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": V,
             "bos_token_id": 1, "eos_token_id": EOS}
    (tmp_path / "config.json").write_text(json.dumps(small))  # the file as published, not as re-saved
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path),
                                                       attn_implementation="eager", dtype=torch.float32)
    reinit_(hf)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(tmp_path)
    assert model.config.rope_type == "llama3" and model.config.rope_theta == 500000.0
    tokens, key_valid = ragged_batch()
    got = timlab_logits(model, tokens, key_valid)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32)
    assert float((hf_logits(ref.eval(), tokens, key_valid) - got)[key_valid].abs().max()) <= TOL


def test_unsupported_rope_type_is_refused(tmp_path):
    path = _saved_hf(tmp_path, CASES[0])
    d = json.loads((path / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    d.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(d))
    msg = _one_line_error(path)
    assert "unsupported rope_type='longrope'" in msg and "default, linear, dynamic, llama3, yarn" in msg


def test_left_padding_does_not_change_a_rows_logits(tmp_path):
    """The same sequence alone and left-padded inside a ragged batch: same logits (HF and timlab)."""
    model = load_model(_saved_hf(tmp_path, CASES[0]))
    tokens, key_valid = ragged_batch()
    alone = tokens[2:3, 11:]  # row 2 without its 11 padding columns
    got_alone = timlab_logits(model, alone, torch.ones_like(alone, dtype=torch.bool))
    got_batch = timlab_logits(model, tokens, key_valid)
    assert float((got_alone[0] - got_batch[2, 11:]).abs().max()) <= TOL


# ------------------------------------------------------------------------------ load errors
def _one_line_error(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_load_error_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    msg = _one_line_error(tmp_path)
    assert "unsupported architecture" in msg and "gpt2" in msg and "llama, qwen2, qwen3" in msg


def test_load_error_missing_config(tmp_path):
    assert "no config.json" in _one_line_error(tmp_path)


def test_load_error_missing_weight(tmp_path):
    path = _saved_hf(tmp_path, CASES[0])
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    msg = _one_line_error(path)
    assert "missing weight" in msg and "model.layers.1.mlp.up_proj.weight" in msg


def test_load_error_misshaped_weight(tmp_path):
    path = _saved_hf(tmp_path, CASES[0])
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 48)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    msg = _one_line_error(path)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(7, 48)" in msg and "expected (16, 48)" in msg


def test_load_error_no_weights_file(tmp_path):
    path = _saved_hf(tmp_path, CASES[0])
    (path / "model.safetensors").unlink()
    assert "no model.safetensors" in _one_line_error(path)


# ------------------------------------------------------------------------------ the hf engine
def timlab_model(tmp_path, case=CASES[0], dtype="float32") -> CausalLM:
    return load_model(_saved_hf(tmp_path, case), dtype=dtype)


def prompts(n: int = 9) -> list[list[int]]:
    return [[3 + (5 * i + 7 * j) % (V - 3) for j in range(1 + i % 7)] for i in range(n)]


def _eos_likely_(model: CausalLM, shift: float = 4.0) -> None:
    """Raise EOS's logit along the mean final hidden state so rows finish at different steps."""
    tokens = torch.randint(3, V, (8, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.hidden_states(tokens, full_step(torch.ones_like(tokens, dtype=torch.bool)))
        u = h.reshape(-1, h.shape[-1]).mean(0)
        model.lm_head.weight[EOS] += shift * u / u.norm() ** 2


def _trainer_logp(model, r):
    logp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
    return logp.detach()


def test_hf_engine_rollouts_close_to_trainer(tmp_path):
    model = timlab_model(tmp_path, CASES[2])  # untied qwen2
    _eos_likely_(model)
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(prompts(), max_new_tokens=16, generator=torch.Generator().manual_seed(0))
    B, S = r.tokens.shape
    assert S % 16 == 0 and S >= r.prompt_width + 16
    m = r.response_mask
    assert torch.equal(r.lengths, m.sum(-1)) and len(set(r.lengths.tolist())) > 1
    for b in range(B):  # the mask ends at EOS exactly, nothing after it
        resp = r.tokens[b][m[b]]
        assert (resp[:-1] != EOS).all() and bool(resp[-1] == EOS) == bool(r.finished[b])
        assert (r.tokens[b, r.prompt_width + int(r.lengths[b]) :] == PAD).all()
    diff = (_trainer_logp(model, r) - r.logprobs)[m].abs()
    assert float(diff.max()) < 1e-4
    assert torch.equal(r.sampling_logprobs[m], r.logprobs[m])  # no truncation: same distribution
    assert float((engine.score(r.tokens, r.key_valid) - r.logprobs)[m].abs().max()) < 1e-4


def test_hf_engine_greedy_matches_exact_engine(tmp_path):
    """Same layout, same positions, same padding: greedy tokens agree with timlab's exact engine."""
    model = timlab_model(tmp_path, CASES[0])
    _eos_likely_(model)
    greedy = SamplingParams(temperature=0)
    a, b = (build_engine(name, model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts(), max_new_tokens=12, sampling=greedy) for name in ("hf", "exact"))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.finished, b.finished)
    assert float((a.logprobs - b.logprobs).abs().max()) < 1e-4
    assert torch.equal(a.sampling_logprobs, torch.zeros_like(a.sampling_logprobs))


def test_hf_engine_seed_reproducibility_and_global_rng(tmp_path):
    model = timlab_model(tmp_path)
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)

    def run(seed):
        return engine.generate(prompts(), max_new_tokens=12, generator=torch.Generator().manual_seed(seed))

    state = torch.random.get_rng_state()
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(torch.random.get_rng_state(), state)  # generate forks the global RNG
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def test_hf_engine_truncation_and_temperature(tmp_path):
    model = timlab_model(tmp_path)
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(prompts(), max_new_tokens=12, sampling=SamplingParams(top_k=3),
                        generator=torch.Generator().manual_seed(0))
    m = r.response_mask
    assert (r.sampling_logprobs[m] >= r.logprobs[m]).all()
    logits = timlab_logits(model, r.tokens, r.key_valid)
    b, c = m.nonzero(as_tuple=True)
    top3 = logits[b, c - 1].topk(3, -1).indices  # HF would use 50 if top_k were not passed
    assert (top3 == r.tokens[b, c][:, None]).any(-1).all()
    r = engine.generate(prompts(), max_new_tokens=12, sampling=SamplingParams(temperature=0.5),
                        generator=torch.Generator().manual_seed(0))
    b, c = r.response_mask.nonzero(as_tuple=True)
    logits = timlab_logits(model, r.tokens, r.key_valid)
    expected = torch.log_softmax(logits[b, c - 1] / 0.5, -1).gather(-1, r.tokens[b, c][:, None]).squeeze(-1)
    assert float((r.sampling_logprobs[b, c] - expected).abs().max()) < 1e-4


def test_hf_engine_logits_processor(tmp_path):
    """An injected processor defines log mu and changes what is sampled (here: token 5 banned)."""
    model = timlab_model(tmp_path)
    columns = []

    def ban_5(logits, col):
        columns.append(int(col[0]))
        return logits.index_fill(-1, torch.tensor([5]), float("-inf"))

    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(prompts(), max_new_tokens=12, generator=torch.Generator().manual_seed(0),
                        logits_processor=ban_5)
    m = r.response_mask
    assert not (r.tokens[m] == 5).any()
    assert columns[: 12] == list(range(r.prompt_width, r.prompt_width + 12))
    logits = timlab_logits(model, r.tokens, r.key_valid)
    b, c = m.nonzero(as_tuple=True)
    expected = torch.log_softmax(ban_5(logits[b, c - 1], c), -1).gather(-1, r.tokens[b, c][:, None]).squeeze(-1)
    assert float((r.logprobs[b, c] - expected).abs().max()) < 1e-4


def test_hf_engine_follows_weight_updates(tmp_path):
    model = timlab_model(tmp_path)
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    engine.generate(prompts(), max_new_tokens=4)
    with torch.no_grad():  # an optimizer-like in-place update
        for p in model.parameters():
            p.mul_(1.1)
    r = engine.generate(prompts(), max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    assert float((_trainer_logp(model, r) - r.logprobs)[r.response_mask].abs().max()) < 1e-4
    engine.sync_weights()  # explicit sync is idempotent
    hf_w = engine.hf_model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(hf_w, model.model.layers[0].mlp.down_proj.weight)


def test_hf_engine_bf16(tmp_path):
    model = timlab_model(tmp_path, dtype="bfloat16")
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    assert engine.hf_model.dtype == torch.bfloat16
    r = engine.generate(prompts(), max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    diff = (_trainer_logp(model, r) - r.logprobs)[r.response_mask].abs()
    assert float(diff.max()) < 0.1  # bf16 kernels differ; close, not equal


def test_hf_engine_without_transformers(monkeypatch):
    from timlab.engines.hf import MISSING_TRANSFORMERS

    model = CausalLM(ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises
    with pytest.raises(ImportError) as e:
        build_engine("hf", model, eos_token_id=EOS)
    assert str(e.value) == MISSING_TRANSFORMERS == "the hf engine needs transformers: pip install timlab[hf]"
    assert isinstance(e.value, ValueError)  # so the CLI prints it as one line


def test_hf_engine_processor_reading_tokens(tmp_path):
    """A ``reads_tokens`` processor gets HF's input_ids, the (B, col) tokens so far: one that
    allows only each row's previous token makes every response token a copy of its prompt's last."""
    model = timlab_model(tmp_path)
    calls = []

    def copy_last(logits, col, tokens):
        calls.append(tuple(tokens.shape))
        assert tokens.shape == (logits.shape[0], int(col[0]))
        keep = torch.full_like(logits, float("-inf")).scatter(-1, tokens[:, -1:], 0.0)
        return logits + keep

    copy_last.reads_tokens = True
    engine = build_engine("hf", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(prompts(), max_new_tokens=12, generator=torch.Generator().manual_seed(0),
                        logits_processor=copy_last)
    P = r.prompt_width
    assert (r.lengths == 12).all()  # no row ended: EOS was never allowed
    assert torch.equal(r.tokens[:, P : P + 12], r.tokens[:, P - 1 : P].expand(-1, 12))
    assert calls == [(len(prompts()), P + i) for i in range(12)]
