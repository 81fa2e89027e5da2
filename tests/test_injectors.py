"""Injected mismatch: the realized k3 KL is measured, grows with the knob, and never touches the trainer."""

from __future__ import annotations

import pytest
import torch

from timlab.config import MismatchSection
from timlab.engines import SamplingParams
from timlab.errors import UsageError
from timlab.injectors import build_injector, parse_parts, round_weight
from timlab.metrics import offpolicy_metrics
from timlab.model.forward import token_logprobs
from timlab.model.llama import CausalLM, ModelConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m.eval()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 4


def realized(model, injector="none", magnitude=0.0, **kw):
    sec = MismatchSection(injector=injector, magnitude=magnitude, **kw)
    inj = build_injector(sec, model, eos_token_id=2, pad_token_id=0)
    r = inj.rollout(PROMPTS, max_new_tokens=24, sampling=SamplingParams(), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        lp, _ = token_logprobs(model, r.tokens, r.key_valid)
    return offpolicy_metrics(lp.detach(), r.logprobs, r.response_mask.float())["k3_kl"], r


def test_none_is_exactly_zero(model):
    k3, r = realized(model)
    assert k3 == 0.0


@pytest.mark.parametrize("injector, magnitudes", [
    ("logit_noise", [0.05, 0.2, 0.5, 1.0]),
    ("temperature", [0.05, 0.2, 0.5, 1.0]),
    ("head_perturb", [0.05, 0.2, 0.5, 1.0]),
])
def test_k3_grows_monotonically_with_magnitude(model, injector, magnitudes):
    ks = [realized(model, injector, m)[0] for m in magnitudes]
    assert ks[0] > 0
    assert all(a < b for a, b in zip(ks, ks[1:])), ks


def test_path_injectors_realize_a_small_real_mismatch(model):
    k_bf16 = realized(model, "precision", dtype="bfloat16")[0]
    k_fp16 = realized(model, "precision", dtype="float16")[0]
    k_fast = realized(model, "engine", engine="fast")[0]
    k_r16 = realized(model, "weight_rounding", dtype="float16")[0]
    k_rbf = realized(model, "weight_rounding", dtype="bfloat16")[0]
    k_r8 = realized(model, "weight_rounding", dtype="int8")[0]
    assert 0 < k_fast < k_fp16 < k_bf16  # fp32 kernels < fp16 (10 mantissa bits) < bf16 (7)
    assert 0 < k_r16 < k_rbf
    assert k_r8 > 0


def test_composition_and_scope(model):
    both = realized(model, "precision+logit_noise", 0.5)[0]
    assert both > realized(model, "precision")[0]
    # scope: perturb only low-probability vocabulary entries -> less mismatch than everywhere
    scoped = realized(model, "temperature", 1.0, prob_below=0.05)[0]
    assert 0 < scoped < realized(model, "temperature", 1.0)[0]


@pytest.mark.parametrize("injector", ["temperature", "logit_noise", "head_perturb"])
def test_entropy_scope_perturbs_only_the_chosen_tokens(model, injector):
    """entropy_min / entropy_max: a token whose trainer entropy lies outside [min, max) gets the
    trainer's log-prob bit for bit (r exactly 0); inside, the rollout is perturbed. The two scopes
    split the unscoped mismatch, each a part of it."""
    every, r = realized(model, injector, 0.5)
    _, ent = token_logprobs(model, r.tokens, r.key_valid, with_entropy=True)
    cut = float(ent[r.response_mask].median())  # the random model's entropies span 3.31-3.45 nats
    k_hi, r = realized(model, injector, 0.5, entropy_min=cut)
    with torch.enable_grad():
        lp, ent = token_logprobs(model, r.tokens, r.key_valid, with_entropy=True)
    mask = r.response_mask
    diff = (lp.detach() - r.logprobs)[mask]
    ent = ent[mask]
    low, high = ent < cut - 1e-4, ent > cut + 1e-4
    assert low.sum() >= 10 and high.sum() >= 10  # both kinds of token occur
    assert (diff[low] == 0).all()  # out of scope: exact
    assert (diff[high] != 0).float().mean() > 0.9  # in scope: perturbed
    k_lo = realized(model, injector, 0.5, entropy_max=cut)[0]
    assert 0 < k_hi < every and 0 < k_lo < every


@pytest.mark.parametrize("kw, msg", [
    ({"injector": "precision", "entropy_min": 1.0}, "mismatch.entropy_min scopes head_perturb, logit_noise, temperature only"),
    ({"injector": "stale", "position_max": 4}, "mismatch.position_max scopes head_perturb, logit_noise, temperature only"),
    ({"injector": "head_perturb+precision", "entropy_min": 1.0},
     "confines head_perturb only when the rest of the rollout is the trainer's own model, and part precision changes"),
    ({"injector": "head_perturb+engine", "position_min": 3}, "and part engine changes the rest of the rollout"),
    ({"injector": "temperature", "position_min": -1}, "mismatch.position_min must be a response token index >= 0"),
    ({"injector": "temperature", "position_min": 5, "position_max": 5}, "position_min \\(5\\) must be below"),
    ({"injector": "temperature", "entropy_max": -1.0}, "mismatch.entropy_max must be a finite number of nats >= 0"),
    ({"injector": "temperature", "entropy_min": 2.0, "entropy_max": 1.0}, "must be below mismatch.entropy_max"),
])
def test_bad_entropy_scopes(model, kw, msg):
    with pytest.raises(Exception, match=msg):
        realized(model, magnitude=0.5, **kw)


@pytest.mark.parametrize("injector", ["temperature", "logit_noise", "head_perturb"])
def test_position_scope_perturbs_only_the_chosen_positions(model, injector):
    """position_min / position_max: response tokens at index [4, 12) are perturbed, every other one
    keeps the trainer's log-prob bit for bit; the two halves of the responses split the mismatch."""
    every, _ = realized(model, injector, 0.5)
    k_mid, r = realized(model, injector, 0.5, position_min=4, position_max=12)
    with torch.enable_grad():
        lp, _ = token_logprobs(model, r.tokens, r.key_valid)
    P = max(len(p) for p in PROMPTS)
    index = torch.arange(r.tokens.shape[1]) - P  # (S,) response token index
    inside = r.response_mask & ((index >= 4) & (index < 12))[None]
    outside = r.response_mask & ~inside
    diff = lp.detach() - r.logprobs
    assert outside.sum() >= 50 and inside.sum() >= 50
    assert (diff[outside] == 0).all()  # out of scope: exact
    assert (diff[inside] != 0).float().mean() > 0.9  # in scope: perturbed
    k_head = realized(model, injector, 0.5, position_max=12)[0]
    k_tail = realized(model, injector, 0.5, position_min=12)[0]
    assert 0 < k_mid < k_head < every and 0 < k_tail < every


def test_head_perturb_scoped_everywhere_is_the_unscoped_rollout_bit_for_bit(model):
    """The kept-logits path (head_perturb under a scope) samples from the same perturbed logits: a
    scope that holds every token gives the unscoped rollout's tokens and log-probs exactly."""
    _, plain = realized(model, "head_perturb", 0.5)
    _, scoped = realized(model, "head_perturb", 0.5, position_max=10_000)
    assert torch.equal(plain.tokens, scoped.tokens) and torch.equal(plain.logprobs, scoped.logprobs)


class Vocab:
    """A stand-in tokenizer for the marker scopes: 'x' is token 4 (sampled in most of the random
    model's responses, at varying places), 'y' token 23; 'end' is the EOS, 'big' lies outside the
    model's vocabulary of 32, '?' is the unknown token 3; every other text is two tokens."""

    eos_token_id, pad_token_id = 2, 0

    ids = {"x": 4, "y": 23, "end": 2, "big": 40, "?": 3}

    def encode(self, text):
        return [self.ids[text]] if text in self.ids else [1, 1]

    def decode(self, ids, skip_special_tokens=True):
        return "" if ids == [3] else "".join(t for t, i in self.ids.items() if [i] == ids)  # 3: <unk>


def realized_marked(model, injector, magnitude, **kw):
    """``realized`` with the stand-in tokenizer, and the per-token log-ratios and whether each
    response token comes after the first 'x' (token 4) of its row (its own step excluded)."""
    sec = MismatchSection(injector=injector, magnitude=magnitude, **kw)
    inj = build_injector(sec, model, eos_token_id=2, pad_token_id=0, tokenizer=Vocab())
    r = inj.rollout(PROMPTS, max_new_tokens=24, sampling=SamplingParams(), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        lp, _ = token_logprobs(model, r.tokens, r.key_valid)
    mask = r.response_mask
    k3 = offpolicy_metrics(lp.detach(), r.logprobs, mask.float())["k3_kl"]
    is_mark = (r.tokens == 4) & mask  # (B, S)
    after = (is_mark.long().cumsum(-1) - is_mark.long()) > 0  # a marker strictly before the column
    return k3, lp.detach() - r.logprobs, mask & after, mask & ~after


@pytest.mark.parametrize("injector", ["temperature", "logit_noise", "head_perturb"])
def test_marker_scopes_perturb_only_after_or_before_the_marker(model, injector):
    """after_text: steps whose response so far holds the marker are perturbed, every step up to and
    including the marker's own keeps the trainer's log-prob bit for bit (r exactly 0); before_text
    is the reverse. The two split the unscoped mismatch."""
    every = realized(model, injector, 0.5)[0]
    k_after, diff, after, before = realized_marked(model, injector, 0.5, after_text="x")
    assert after.sum() >= 40 and before.sum() >= 40  # the marker occurs mid-response in many rows
    assert (diff[before] == 0).all()  # out of scope: exact
    assert (diff[after] != 0).float().mean() > 0.9  # in scope: perturbed
    k_before, diff, after, before = realized_marked(model, injector, 0.5, before_text="x")
    assert after.sum() >= 40 and before.sum() >= 40
    assert (diff[after] == 0).all()
    assert (diff[before] != 0).float().mean() > 0.9
    assert 0 < k_after < every and 0 < k_before < every


def test_marker_scope_combines_with_a_position_scope_by_and(model):
    """after_text with position_max=12: only tokens after the marker AND at response index < 12."""
    _, diff, after, before = realized_marked(model, "temperature", 0.5, after_text="x", position_max=12)
    P = max(len(p) for p in PROMPTS)
    early = (torch.arange(diff.shape[1]) - P < 12)[None]  # (1, S)
    inside = after & early
    outside = (after | before) & ~inside  # response tokens out of scope
    assert inside.sum() >= 20 and (after & ~early).sum() >= 20
    assert (diff[outside] == 0).all()
    assert (diff[inside] != 0).float().mean() > 0.9


@pytest.mark.parametrize("kw, msg", [
    ({"injector": "temperature", "after_text": "ab"}, "mismatch.after_text 'ab' is 2 tokens of the model's tokenizer"),
    ({"injector": "temperature", "before_text": "end"}, "mismatch.before_text 'end' is token 2, not an ordinary token"),
    ({"injector": "temperature", "after_text": "big"}, "'big' is token 40, not an ordinary token .* vocabulary of 32"),
    ({"injector": "temperature", "after_text": "?"}, "'\\?' is token 3, not an ordinary token .* decodes back to it"),
    ({"injector": "temperature", "after_text": 3}, "mismatch.after_text must be a text of one token"),
    ({"injector": "precision", "after_text": "x"}, "mismatch.after_text scopes head_perturb, logit_noise, temperature"),
    ({"injector": "temperature", "after_text": "x", "before_text": "x"}, "are both 'x': no decode step is in scope"),
    ({"injector": "head_perturb+precision", "before_text": "x"}, "a per-step scope .* confines head_perturb only"),
])
def test_bad_marker_scopes(model, kw, msg):
    with pytest.raises(UsageError, match=msg):
        realized_marked(model, magnitude=0.5, **kw)


def test_marker_scope_with_an_observer_is_the_same_rollout(model):
    """gradcheck's ``observe`` wraps the processor: the wrapper still gets the tokens so far, so the
    rollout is the same bit for bit, and the observer sees every decode step's processed logits."""
    inj = build_injector(MismatchSection(injector="head_perturb", magnitude=0.5, after_text="x"), model,
                         eos_token_id=2, pad_token_id=0, tokenizer=Vocab())
    seen = []

    def run(observe=None):
        return inj.rollout(PROMPTS, max_new_tokens=24, sampling=SamplingParams(),
                           generator=torch.Generator().manual_seed(0), observe=observe)

    plain, watched = run(), run(lambda logits, col: seen.append(logits.shape))
    assert torch.equal(plain.tokens, watched.tokens) and torch.equal(plain.logprobs, watched.logprobs)
    assert len(seen) == int(watched.lengths.max()) and seen[0] == (len(PROMPTS), 32)


def test_marker_scope_needs_the_tokenizer(model):
    with pytest.raises(UsageError, match="mismatch.after_text needs the model's tokenizer"):
        build_injector(MismatchSection(injector="temperature", magnitude=0.5, after_text="x"), model,
                       eos_token_id=2, pad_token_id=0)


def test_trainer_weights_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    realized(model, "head_perturb+weight_rounding", 1.0, dtype="int8")
    realized(model, "precision", dtype="float16")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_round_weight():
    w = torch.tensor([[1.0, -0.5, 0.25], [3.0, 0.001, -3.0]])
    q = round_weight(w, "int8")
    assert torch.allclose(q, w, atol=3.0 / 127)
    assert q[0, 0] == 1.0 and q[1, 0] == 3.0  # the row max is exact
    assert torch.equal(round_weight(w, "bfloat16"), w.to(torch.bfloat16).float())


@pytest.mark.parametrize("spec, msg", [
    ("magic", "unknown injector 'magic'; valid choices:"),
    ("", "mismatch.injector is empty"),
    ("temperature+temperature", "names a part twice"),
])
def test_bad_specs(spec, msg):
    with pytest.raises(Exception, match=msg):
        parse_parts(spec)


def test_scope_needs_a_logits_injector(model):
    with pytest.raises(ValueError, match="prob_below scopes logit_noise and temperature only"):
        realized(model, "precision", prob_below=0.1)


# ------------------------------------------------------------------------------ the plug point
def test_every_module_registers_one_injector_class():
    import pkgutil

    import timlab.injectors as pkg
    from timlab.injectors import INJECTORS, Injector

    modules = {m.name for m in pkgutil.iter_modules(pkg.__path__)} - {"base", "schedule", "controller"}
    classes = {name: INJECTORS.get(name) for name in INJECTORS.names() if name != "none"}
    assert all(issubclass(cls, Injector) and cls.name == name for name, cls in classes.items())
    assert {cls.__module__.rsplit(".", 1)[1] for cls in classes.values()} == modules
    from timlab.injectors.base import MAGNITUDE_KINDS

    kinds = {name: cls.magnitude_kind for name, cls in classes.items()}
    assert set(kinds.values()) <= set(MAGNITUDE_KINDS)
    assert {n for n, k in kinds.items() if k != "none"} == {"head_perturb", "kv_cache", "logit_noise", "stale", "temperature"}


def test_a_new_injector_is_one_class_and_needs_no_other_edit(model, monkeypatch):
    """Registered here as a user's file would register it; the spec, composition with '+', the
    scope, checks and checkpoint state all work through the protocol alone."""
    from timlab.injectors import INJECTORS, Injector, register
    from timlab.errors import UsageError

    monkeypatch.setattr(INJECTORS, "_items", dict(INJECTORS._items))  # forget it after the test

    @register("ban_token")
    class BanToken(Injector):
        """The rollout never samples token ``int(magnitude)``; counts the steps it saw."""

        order = 45
        processes_logits = True
        scoped = True

        def __init__(self, settings):
            super().__init__(settings)
            self.steps = 0

        def check(self):
            if self.settings.magnitude >= 32:
                raise UsageError("ban_token: magnitude must name a token id")

        def process_logits(self, logits, col, generator):
            self.steps += 1
            return logits.index_fill(-1, torch.tensor([int(self.settings.magnitude)]), -1e4)

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    k3, r = realized(model, "ban_token+precision", 7.0, dtype="float16")
    assert k3 > 0 and not (r.tokens[r.response_mask] == 7).any()
    sec = MismatchSection(injector="precision+ban_token", magnitude=7.0, dtype="float16")
    inj = build_injector(sec, model, eos_token_id=2, pad_token_id=0)
    inj.rollout(PROMPTS, max_new_tokens=5, sampling=SamplingParams(), generator=torch.Generator().manual_seed(0))
    assert inj.state_dict()["ban_token"] == {"steps": 5}
    with pytest.raises(UsageError, match="ban_token: magnitude"):
        realized(model, "ban_token", 40.0)
    with pytest.raises(ValueError, match="prob_below scopes ban_token and logit_noise and temperature only"):
        realized(model, "precision", prob_below=0.1)


def test_part_order_not_spec_order():
    """'a+b' and 'b+a' are one injector: the parts act in their declared order."""
    from timlab.injectors import INJECTORS

    orders = {name: INJECTORS.get(name).order for name in INJECTORS.names() if name != "none"}
    assert orders["weight_rounding"] < orders["head_perturb"] < orders["precision"]  # round, new head, cast
    assert orders["temperature"] < orders["logit_noise"]  # noise on the tempered logits


@pytest.mark.parametrize("raw, text", [(":", ":"), ('":"', ":"), ("' '", " "), (">", ">"), ("#", "#"), ("1", "1"), (";", ";")])
def test_a_marker_on_the_command_line_is_the_text_as_written(raw, text):
    """``--set mismatch.after_text=:`` is the text ':' (YAML would refuse it, read '>' as '' and '#'
    as null): a text field takes the text after '=', less one pair of enclosing quotes; the other
    fields are still read as YAML."""
    from timlab.config import parse_set, resolve

    cfg = resolve(overrides=parse_set(["mismatch.injector=head_perturb", f"mismatch.after_text={raw}",
                                       "mismatch.magnitude=0.5", "run.seed=3"]))
    assert cfg.mismatch.after_text == text and cfg.mismatch.injector == "head_perturb"
    assert cfg.mismatch.magnitude == 0.5 and cfg.run.seed == 3


def test_training_with_a_marker_scope(tmp_path, capsys):
    """The trainer hands its tokenizer to the injector: a smoke run on scratch_add (restate 1) with
    head_perturb after ':' trains and realizes some k3; a marker outside the vocabulary is refused
    in one line before training."""
    import pandas as pd

    from timlab import cli

    sets = ["task.name=scratch_add", "task.kwargs={restate: 1, max_digits: 2}", "model.pretrain_steps=30",
            "mismatch.injector=head_perturb", "mismatch.magnitude=0.5", "rollout.max_new_tokens=24"]
    base = ["train", "--preset", "smoke", *[a for kv in sets for a in ("--set", kv)], "--quiet"]
    assert cli.main([*base, "--set", "mismatch.after_text=:", "--run-dir", str(tmp_path / "r")]) == 0
    k3 = pd.read_parquet(tmp_path / "r" / "metrics.parquet")["rollout_corr/k3_kl"].dropna()
    assert len(k3) == 4 and (k3 > 0).any()
    capsys.readouterr()
    assert cli.main([*base, "--set", "mismatch.after_text=?", "--run-dir", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert "mismatch.after_text '?' is token 3, not an ordinary token" in err and "\n" not in err


def test_head_perturb_redraws_its_direction_every_n_steps(model):
    """mismatch.redraw_every: R stays for n training steps, then a new one is drawn from (seed, its
    index); 0 keeps the run-long R of before (draw 0, the same bits); a fresh injector asked for a
    later step (a resumed run) draws that step's R; the head's size relative to W is the same."""
    from timlab.config import resolve

    def head(inj):
        return inj.rollout_model.lm_head.weight.detach().clone()

    sec = MismatchSection(injector="head_perturb", magnitude=0.3, seed=4, redraw_every=2)
    inj = build_injector(sec, model, eos_token_id=2, pad_token_id=0)
    once = build_injector(MismatchSection(injector="head_perturb", magnitude=0.3, seed=4), model,
                          eos_token_id=2, pad_token_id=0)
    heads = []
    for step in range(1, 7):
        inj.begin_step(step)
        once.begin_step(step)
        heads.append(head(inj))
        assert torch.equal(head(once), heads[0])  # redraw_every 0: one R for the run
    assert torch.equal(heads[0], heads[1]) and torch.equal(heads[2], heads[3]) and torch.equal(heads[4], heads[5])
    assert not torch.equal(heads[1], heads[2]) and not torch.equal(heads[3], heads[4])
    W = model.lm_head.weight.detach()
    sizes = [float((h - W).norm() / W.norm()) for h in heads]
    assert sizes == pytest.approx([0.3] * 6, rel=1e-5)
    resumed = build_injector(sec, model, eos_token_id=2, pad_token_id=0)
    resumed.begin_step(5)
    assert torch.equal(head(resumed), heads[4])
    other_seed = build_injector(MismatchSection(injector="head_perturb", magnitude=0.3, seed=5, redraw_every=2), model,
                                eos_token_id=2, pad_token_id=0)
    other_seed.begin_step(3)
    assert not torch.equal(head(other_seed), heads[2])
    assert resolve(preset="smoke").hash() == resolve(preset="smoke", overrides=["mismatch.redraw_every=0"]).hash()
    with pytest.raises(UsageError, match="mismatch.redraw_every renews the direction of head_perturb only"):
        build_injector(MismatchSection(injector="logit_noise", magnitude=0.3, redraw_every=2), model,
                       eos_token_id=2, pad_token_id=0)
