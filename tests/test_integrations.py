"""The TRL and verl plug-ins (timlab.integrations) on CPU.

verl tests run on plain tensors shaped like verl's batch; the comparison with verl's own
``compute_offpolicy_metrics`` runs verl's installed source (the function and the two helpers it
calls, extracted with ``ast``: importing verl needs ray). TRL tests run ``GRPOTrainer`` for a few
steps on a tiny random Llama written by timlab, with the char tokenizer. Both skip cleanly when
the library is absent.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from timlab.metrics import advantage_metrics, all_metrics, decision_token_metrics
from timlab.metrics.persistence import PERSISTENCE_KEYS, PersistenceTracker
from timlab.schedulers import LengthDecayLR
from timlab.integrations import verl as tv

# ------------------------------------------------------------------------------ helpers


def verl_like_batch(B=6, T=9, seed=0, scale=0.3, dtype=torch.float64):
    """Tensors named and shaped like verl's batch: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    P = 5
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # every row has >= 1 response token
    response_mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P)[None] >= (P - prompt_len)[:, None]).long()  # (B, P)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3  # log pi_old
    rollout = old + scale * torch.randn(B, T, generator=g, dtype=dtype)  # log mu
    rollout = rollout.clamp(max=0.0)
    return {
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "response_mask": response_mask,
        "responses": torch.randint(4, 30, (B, T), generator=g),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),  # (B, P + T)
    }


def _extract(path: Path, names: set[str]) -> ast.Module:
    """Top-level functions / assignments of ``path`` whose names are in ``names``."""
    if not path.exists():
        pytest.skip(f"{path} not found in the installed verl")
    tree = ast.parse(path.read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets):
            keep.append(node)
    found = {getattr(n, "name", None) or n.targets[0].id for n in keep}
    if found != names:
        pytest.skip(f"{path.name}: could not find {sorted(names - found)} in the installed verl")
    return ast.Module(body=keep, type_ignores=[])


def verl_compute_offpolicy_metrics():
    """verl's own compute_offpolicy_metrics, run from the installed verl's source files."""
    spec = importlib.util.find_spec("verl")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    from typing import Any, Optional

    ns: dict = {"torch": torch, "math": math, "Optional": Optional, "Any": Any}
    exec(compile(_extract(root / "utils" / "torch_functional.py", {"masked_sum", "masked_mean"}), "verl_F", "exec"), ns)
    ns["verl_F"] = SimpleNamespace(masked_sum=ns["masked_sum"], masked_mean=ns["masked_mean"])
    helper = root / "trainer" / "ppo" / "rollout_corr_helper.py"
    exec(compile(_extract(helper, {"SAFETY_BOUND", "compute_offpolicy_metrics"}), str(helper), "exec"), ns)
    return ns["compute_offpolicy_metrics"]


# ------------------------------------------------------------------------------ verl: metrics


def test_verl_compute_metrics_equals_all_metrics_for_dict_and_dataproto_like():
    b = verl_like_batch()
    want = all_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    assert tv.compute_metrics(b) == want
    assert tv.compute_metrics(SimpleNamespace(batch=b)) == want  # DataProto: tensors under .batch
    no_mask = {k: v for k, v in b.items() if k != "response_mask"}  # verl's fallback: attention_mask[:, -T:]
    assert tv.compute_metrics(no_mask) == want
    assert set(want) == {k for k in want if k.startswith(("rollout_corr/", "mismatch/"))}


def test_verl_compute_metrics_on_verls_own_dataproto():
    protocol = pytest.importorskip("verl.protocol")
    b = verl_like_batch()
    proto = protocol.DataProto.from_dict(dict(b))
    assert tv.compute_metrics(proto) == all_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    assert tv.response_length_mean(proto) == tv.response_length_mean(b)


def test_verl_compute_metrics_hand_computed():
    # two sequences, r = log pi - log mu = 0.1 on every valid token; row 1 has one padded slot
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=torch.float64)
    batch = {"old_log_probs": old, "rollout_log_probs": old - 0.1,
             "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    m = tv.compute_metrics(batch)
    assert m["rollout_corr/kl"] == pytest.approx(-0.1)
    assert m["rollout_corr/k3_kl"] == pytest.approx(math.exp(0.1) - 1.1)
    assert m["rollout_corr/chi2_token"] == pytest.approx(math.exp(0.2) - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((math.exp(0.6) + math.exp(0.4)) / 2 - 1)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(-0.1)
    assert m["rollout_corr/training_log_ppl"] == pytest.approx((3.5 / 3 + 1.0 / 2) / 2)
    assert m["mismatch/abs_diff_mean"] == pytest.approx(0.1)
    assert m["mismatch/log_ppl_abs_diff_sum"] == pytest.approx((0.3 + 0.2) / 2)
    assert m["mismatch/num_tokens"] == 5


def test_verl_compute_metrics_adds_the_harm_statistics_verls_batch_allows():
    b = verl_like_batch()
    train, rollout, mask = b["old_log_probs"], b["rollout_log_probs"], b["response_mask"]
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(6, generator=g, dtype=torch.float64)[:, None] * mask  # (B, T) verl: one value per token
    ent = torch.rand(6, 9, generator=g, dtype=torch.float64)
    with_adv = {**b, "advantages": adv}
    want = {**all_metrics(train, rollout, mask), **advantage_metrics(train, rollout, mask, adv)}
    assert tv.compute_metrics(with_adv) == want
    assert tv.compute_metrics({**with_adv, "entropys": ent}) == {**want, **decision_token_metrics(train, rollout, mask, ent)}
    assert tv.compute_metrics(b, entropy=ent) == {**all_metrics(train, rollout, mask),
                                                  **decision_token_metrics(train, rollout, mask, ent)}
    # after compute_advantage: the advantage-weighted ones alone; verl's per-token A equals one per sequence here
    assert tv.advantage_metrics(with_adv) == advantage_metrics(train, rollout, mask, adv)
    assert tv.advantage_metrics(with_adv) == pytest.approx(advantage_metrics(train, rollout, mask, adv[:, 0]), rel=1e-12)
    assert tv.advantage_metrics(with_adv)["mismatch/adv_diff_mean"] == pytest.approx(
        float(((train - rollout) * adv)[mask.bool()].mean()), rel=1e-12)
    with pytest.raises(KeyError, match="compute_advantage"):
        tv.advantage_metrics(b)


def test_verl_mismatch_persistence_logs_a_planted_persistent_bias():
    """A per-token-id bias that keeps its direction: NaN at the first step (reliability excepted),
    finite and near 1 after; exactly ``PersistenceTracker`` on the same tensors; state round trip."""
    g = torch.Generator().manual_seed(11)
    bias = 0.3 * torch.randn(30, generator=g, dtype=torch.float64)  # ids of verl_like_batch: 4..29
    p, ref = tv.MismatchPersistence(vocab_size=30), PersistenceTracker(30)
    rows = []
    for step in range(4):
        b = verl_like_batch(B=16, T=12, seed=step, scale=0.0)
        b["old_log_probs"] = b["old_log_probs"] - 1.0
        noise = 0.02 * torch.randn(16, 12, generator=g, dtype=torch.float64)
        b["rollout_log_probs"] = b["old_log_probs"] - bias[b["responses"]] - noise  # r = bias[id] + noise
        rows.append(p.update(SimpleNamespace(batch=b)))  # DataProto: tensors under .batch
        assert rows[-1] == ref.update(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], b["responses"])
    assert math.isnan(rows[0][PERSISTENCE_KEYS[0]]) and math.isnan(rows[0][PERSISTENCE_KEYS[1]])
    for row in rows[1:]:
        assert set(row) == set(PERSISTENCE_KEYS) and all(v > 0.9 for v in row.values()), row
    resumed = tv.MismatchPersistence(vocab_size=30)
    resumed.load_state_dict(p.state_dict())  # a checkpoint of the state after step 4
    assert resumed.update(b) == p.update(b)  # b (step 4's batch) once more: the same values from both
    with pytest.raises(KeyError, match="'responses'"):
        p.update({k: v for k, v in b.items() if k != "responses"})


def test_verl_compute_metrics_missing_rollout_logprobs_names_the_setting():
    b = verl_like_batch()
    del b["rollout_log_probs"]
    with pytest.raises(KeyError, match="calculate_log_probs"):
        tv.compute_metrics(b)
    with pytest.raises(KeyError, match="response_mask"):
        tv.compute_metrics({"old_log_probs": b["old_log_probs"], "rollout_log_probs": b["old_log_probs"]})


@pytest.mark.parametrize("seed,scale", [(0, 0.01), (1, 0.3), (2, 2.0), (3, 8.0)])
def test_verl_compute_metrics_matches_verls_compute_offpolicy_metrics(seed, scale):
    verl_fn = verl_compute_offpolicy_metrics()
    b = verl_like_batch(B=8, T=12, seed=seed, scale=scale)
    theirs = verl_fn(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    ours = tv.compute_metrics(b)
    assert set(theirs) == {k.removeprefix("rollout_corr/") for k in ours if k.startswith("rollout_corr/")}
    r = (b["old_log_probs"] - b["rollout_log_probs"])[b["response_mask"].bool()]
    # documented departure (timlab.metrics.offpolicy): timlab clamps r to +-20 inside k3_kl, verl does not
    departs = {"k3_kl"} if r.abs().max() > 20 else set()
    assert bool(departs) == (scale > 5)
    for key, value in theirs.items():  # verl's masked_mean adds 1e-8 to each denominator
        if key not in departs:
            assert ours[f"rollout_corr/{key}"] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_verl_response_length_mean_follows_verl():
    b = verl_like_batch()
    T = b["responses"].shape[1]
    assert tv.response_length_mean(b) == pytest.approx(float(b["attention_mask"][:, -T:].sum(-1).float().mean()))
    assert tv.response_length_mean({"response_mask": b["response_mask"]}) == pytest.approx(
        float(b["response_mask"].sum(-1).float().mean()))


# ------------------------------------------------------------------------------ verl: length decay


def test_length_decay_hook_follows_algorithm_1():
    hook = tv.LengthDecayHook(decay_period=2, base_lr=1e-3)
    used = []
    for t in range(1, 11):
        out = hook.update_from_metrics({"response_length/mean": 100.0})
        used.append(out["scheduler/lr_factor"])
        assert out["train/lr"] == pytest.approx(1e-3 * out["scheduler/lr_factor"], rel=1e-12)
        assert out["scheduler/decay_period"] == 2 and math.isnan(out["scheduler/surge_step"])
    assert used == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.1, 0.1, 0.1]  # floor 0.1 from t = 8


def surge_lengths(n=30, jump_at=16):
    return [20.0 + (t % 3) for t in range(1, jump_at)] + [90.0] * (n - jump_at + 1)


def test_length_decay_hook_auto_surge_equals_length_decay_lr():
    hook = tv.LengthDecayHook(decay_period=None)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    ref = LengthDecayLR(opt, decay_period=None)
    for length in surge_lengths():
        assert hook.lr_factor * 0.5 == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        hook.update_from_metrics({"response_length/mean": length})
        opt.step()
        ref.step(response_length=length)
    assert hook.surge_step == ref.surge_step == 17  # median of 3 crosses 2x one update after the jump
    assert hook.decay_period == ref.decay_period == round(1.8 * 17)
    assert hook.num_steps == 30


def test_length_decay_hook_state_dict_round_trip():
    a, b = tv.LengthDecayHook(), tv.LengthDecayHook()
    lengths = surge_lengths(n=40)
    for x in lengths[:14]:
        a.update_from_metrics({"response_length/mean": x})
    b.load_state_dict(a.state_dict())
    for x in lengths[14:]:
        got, want = b.update_from_metrics({"response_length/mean": x}), a.update_from_metrics({"response_length/mean": x})
        assert got == pytest.approx(want, nan_ok=True)
    assert b.surge_step == 17


def test_length_decay_hook_without_length_steps_without_signal():
    hook = tv.LengthDecayHook(decay_period=3)
    out = hook.update_from_metrics({})
    assert math.isnan(out["scheduler/response_length"]) and "train/lr" not in out
    assert hook.num_steps == 1


def test_patched_verl_loop_lr_per_update():
    """The driver/worker split of the verl patch, simulated in one process: the worker's
    optimizer runs every mini-batch of step t at verl's scheduled LR x factor(t)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = 2  # verl's get_constant_schedule_with_warmup: min(1, (k + 1) / ... ) style ramp
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    hook = tv.LengthDecayHook(decay_period=2, base_lr=1e-3)
    seen = []
    for t in range(1, 7):
        factor = hook.lr_factor  # driver -> worker (tu.assign_non_tensor(..., timlab_lr_factor=...))
        tv.apply_lr_factor(opt, factor, scheduler=sched)  # worker, start of train_mini_batch
        tv.apply_lr_factor(opt, factor, scheduler=sched)  # idempotent: based on get_last_lr()
        for _ in range(2):  # two mini-batches, one optimizer step each
            seen.append(opt.param_groups[0]["lr"])
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        sched.step()  # verl steps its own scheduler after the last mini-batch
        hook.update_from_metrics({"response_length/mean": 50.0})  # driver, after compute_data_metrics
    verl_lr = [1e-3 * min(1.0, k / (warmup + 1)) for k in range(1, 7)]
    factors = [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    want = [lr * f for lr, f in zip(verl_lr, factors) for _ in range(2)]
    assert seen == pytest.approx(want, rel=1e-12)


def test_apply_lr_factor_rejects_bad_factor():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="lr factor"):
            tv.apply_lr_factor(opt, bad)


def test_length_decay_from_config():
    cfg = {"timlab": {"length_decay": {"decay_period": 3, "min_lr_ratio": 0.2}},
           "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}}
    hook = tv.length_decay_from_config(cfg)
    assert hook.decay_period == 3 and hook.base_lr == 1e-6
    assert tv.length_decay_from_config({"actor_rollout_ref": {}}) is None
    with pytest.raises(TypeError, match="timlab.length_decay"):
        tv.length_decay_from_config({"timlab": {"length_decay": {"decay_perod": 3}}})


def test_length_decay_from_omegaconf_struct_config():
    """verl's config is a struct-mode DictConfig; `+timlab.length_decay.*=...` adds the section."""
    omegaconf = pytest.importorskip("omegaconf")
    OmegaConf = omegaconf.OmegaConf
    base = OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}, "algorithm": {}})
    OmegaConf.set_struct(base, True)
    assert tv.length_decay_from_config(base) is None
    OmegaConf.set_struct(base, False)  # what hydra's `+key=value` does for a new key
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(["timlab.length_decay.decay_period=null",
                                                        "timlab.length_decay.min_lr_ratio=0.1"]))
    OmegaConf.set_struct(cfg, True)
    hook = tv.length_decay_from_config(cfg)
    assert hook.decay_period is None and hook.base_lr == 1e-6 and hook.lr_factor == 1.0


def test_make_length_decay_scheduler_is_length_decay_lr():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = tv.make_length_decay_scheduler(opt, decay_period=2)
    assert isinstance(sched, LengthDecayLR) and sched.decay_period == 2


# ------------------------------------------------------------------------------ TRL: callback alone


def _drive_callback(cb, lengths, *, state=None, lr=1e-3, warmup=3, start=0):
    """Run a callback through the Trainer's event order with a real optimizer and LambdaLR
    (transformers' linear warmup shape, which the callback must override). Returns the LRs used."""
    from transformers import TrainerControl, TrainerState

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    for _ in range(start):
        opt.step()
        sched.step()
    state = state or TrainerState()
    control = TrainerControl()
    args = SimpleNamespace()
    cb.on_train_begin(args, state, control, optimizer=opt, lr_scheduler=sched)
    used = []
    for length in lengths:
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        cb.on_optimizer_step(args, state, control, optimizer=opt)
        logged_lr = sched.get_last_lr()[0]  # what the Trainer logs as learning_rate
        sched.step()
        state.global_step += 1
        cb.on_step_end(args, state, control)
        assert control.should_log
        logs = {"loss": 0.0, "learning_rate": logged_lr, "completions/mean_length": length}
        state.log_history.append({**logs, "step": state.global_step})
        cb.on_log(args, state, control, logs=logs)
        assert logs["train/lr"] == logged_lr == used[-1]
        assert state.log_history[-1]["train/lr"] == used[-1]
        cb.on_log(args, state, control, logs={"train_runtime": 1.0})  # summary log: ignored
    return used, state


def test_trl_callback_auto_surge_equals_length_decay_lr():
    pytest.importorskip("trl")
    from timlab.integrations.trl import SCHEDULER_KEYS, TimlabCallback

    lengths = surge_lengths(n=45)
    cb = TimlabCallback(decay_period=None)
    used, state = _drive_callback(cb, lengths)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = LengthDecayLR(opt, decay_period=None)
    want = []
    for length in lengths:
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step(response_length=length)
    assert used == pytest.approx(want, rel=1e-12)  # warmup of the Trainer's schedule is gone
    assert cb.surge_step == 17 and cb.decay_period == 31 and used[-1] < used[0]
    last = state.log_history[-1]
    assert set(SCHEDULER_KEYS) <= set(last) and last["scheduler/surge_step"] == 17


def test_trl_callback_resume_replays_log_history():
    pytest.importorskip("trl")
    from transformers import TrainerState

    from timlab.integrations.trl import TimlabCallback

    lengths = surge_lengths(n=40)
    full, _ = _drive_callback(TimlabCallback(decay_period=None), lengths)
    first, state = _drive_callback(TimlabCallback(decay_period=None), lengths[:20])
    resumed_state = TrainerState(global_step=state.global_step, log_history=list(state.log_history))
    cb = TimlabCallback(decay_period=None)
    rest, _ = _drive_callback(cb, lengths[20:], state=resumed_state, start=20)
    assert first + rest == pytest.approx(full, rel=1e-12)
    assert cb.surge_step == 17


def test_trl_callback_rejects_non_lambda_scheduler():
    pytest.importorskip("trl")
    from transformers import TrainerControl, TrainerState

    from timlab.integrations.trl import TimlabCallback

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match="lr_scheduler_type='constant'"):
        TimlabCallback().on_train_begin(None, TrainerState(), TrainerControl(), optimizer=opt, lr_scheduler=plateau)
    with pytest.raises(ValueError, match="decay_period"):
        TimlabCallback(decay_period=0)


# ------------------------------------------------------------------------------ TRL: GRPOTrainer runs


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from timlab.model.hf_io import save_model
    from timlab.model.llama import CausalLM, ModelConfig
    from timlab.tasks import get_task
    from timlab.tokenizer import save_char_tokenizer

    root = tmp_path_factory.mktemp("trl")
    task = get_task("reverse", min_len=2, max_len=5)
    save_char_tokenizer(task.alphabet, root / "tok")
    cfg = ModelConfig(vocab_size=4 + len(task.alphabet), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    save_model(CausalLM(cfg), root / "model", tokenizer_dir=root / "tok")
    examples = task.sample(random.Random(0), 64)
    data = Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})

    def reward(prompts, completions, answer, **kwargs):
        return [task.reward(SimpleNamespace(answer=a), c, dense=True) for c, a in zip(completions, answer)]

    tok = PreTrainedTokenizerFast.from_pretrained(root / "model")  # not AutoTokenizer (docs/integrations.md)
    return SimpleNamespace(root=root, model=str(root / "model"), data=data, reward=reward, tok=tok)


def grpo_args(out: Path, steps: int, **kw):
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        temperature=1.0, top_k=0, learning_rate=1e-3, max_steps=steps, logging_steps=5, warmup_steps=2,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
    )
    return GRPOConfig(**{**settings, **kw})


def make_lr_probe():
    """A callback recording the optimizer's LR right before each optimizer step (independent of timlab)."""
    from transformers import TrainerCallback

    class LRProbe(TrainerCallback):
        def __init__(self):
            self.lrs = []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])

    return LRProbe()


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_trl_grpo_runs_length_decay_lr(trl_setup, tmp_path):
    from trl import GRPOTrainer

    from timlab.integrations.trl import SCHEDULER_KEYS, TimlabCallback

    probe = make_lr_probe()
    cb = TimlabCallback(decay_period=2)
    trainer = GRPOTrainer(model=trl_setup.model, reward_funcs=trl_setup.reward, args=grpo_args(tmp_path, 8),
                          train_dataset=trl_setup.data, processing_class=trl_setup.tok, callbacks=[probe, cb])
    trainer.train()
    lr0 = 1e-3
    want = [lr0, lr0 / 2, lr0 / 2, lr0 / 4, lr0 / 4, lr0 / 8, lr0 / 8, lr0 / 10]  # P = 2, floor 0.1 at update 8
    logs = step_logs(trainer)
    assert [h["step"] for h in logs] == list(range(1, 9))  # a log every update despite logging_steps=5
    assert probe.lrs == pytest.approx(want, rel=1e-12)  # what the optimizer really used (warmup_steps ignored)
    assert [h["learning_rate"] for h in logs] == pytest.approx(want, rel=1e-12)
    assert [h["train/lr"] for h in logs] == pytest.approx(want, rel=1e-12)
    for h in logs:
        assert set(SCHEDULER_KEYS) <= set(h)
        assert h["scheduler/response_length"] == h["completions/mean_length"]
        assert h["scheduler/decay_period"] == 2 and math.isnan(h["scheduler/surge_step"])
        assert not any(k.startswith("mismatch/") for k in h)  # plain GRPOTrainer on CPU: no sampler log-probs


def hf_rollout_func(logprob_offset: float, per_id: torch.Tensor | None = None):
    """A TRL ``rollout_func`` that samples with HF ``generate`` and returns the sampler's log-probs
    shifted by ``-logprob_offset`` (and by ``-per_id[token id]`` when given): a known mismatch, so
    r = log pi - log mu ~= +offset (+ per_id[id])."""

    def rollout_func(prompts, trainer):
        tok, model = trainer.processing_class, trainer.model
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        P = max(map(len, prompt_ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (P - len(x)) + x for x in prompt_ids])  # (B, P) left-padded
        attention = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in prompt_ids])  # (B, P)
        # eval mode: under TRL's default gradient checkpointing, transformers 5.23's generate in train
        # mode drops the KV cache but still feeds one token per step (mean |r| ~0.1 against the
        # trainer; these metrics are how that showed up)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, top_k=0,
                                     top_p=1.0, temperature=1.0, max_new_tokens=trainer.args.max_completion_length,
                                     output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        finally:
            model.train(was_training)
        seq = out.sequences[:, P:]  # (B, C)
        logp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, seq[..., None])[..., 0]  # (B, C)
        completion_ids, logprobs = [], []
        for s, lp in zip(seq.tolist(), logp.tolist()):
            n = s.index(tok.eos_token_id) + 1 if tok.eos_token_id in s else len(s)
            completion_ids.append(s[:n])
            shift = [logprob_offset + (0.0 if per_id is None else float(per_id[t])) for t in s[:n]]
            logprobs.append([x - d for x, d in zip(lp[:n], shift)])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


def test_trl_grpo_logs_mismatch_metrics_with_sampler_logprobs(trl_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from timlab.integrations.trl import TimlabCallback, TimlabGRPOTrainer

    cb = TimlabCallback(decay_period=2)
    trainer = TimlabGRPOTrainer(model=trl_setup.model, reward_funcs=trl_setup.reward, args=grpo_args(tmp_path, 3),
                                train_dataset=trl_setup.data, processing_class=trl_setup.tok, callbacks=[cb],
                                rollout_func=hf_rollout_func(0.05))
    assert trainer.callback_handler.callbacks[0] is cb  # ahead of the report_to loggers
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 3
    for h in logs:
        # r = log pi (TRL's teacher-forced forward) - log mu (HF generate's KV-cached decode - 0.05)
        assert h["mismatch/diff_mean"] == pytest.approx(0.05, abs=1e-3)
        assert h["mismatch/abs_diff_mean"] == pytest.approx(0.05, abs=1e-3)
        assert h["rollout_corr/kl"] == pytest.approx(-0.05, abs=1e-3)
        assert h["rollout_corr/k3_kl"] == pytest.approx(math.exp(0.05) - 1.05, abs=1e-4)
        assert h["mismatch/num_tokens"] > 0 and h["mismatch/frac_tokens_different"] == 1.0
        assert -1.0 <= h["mismatch/adv_diff_corr"] <= 1.0 and math.isfinite(h["mismatch/adv_diff_mean"])
        assert "train/lr" in h
    assert [h["train/lr"] for h in logs] == pytest.approx([1e-3, 5e-4, 5e-4], rel=1e-12)


def test_trl_grpo_logs_the_persistence_of_a_planted_bias(trl_setup, tmp_path, monkeypatch):
    """A per-token-id bias the sampler keeps for the run: the persistence keys are undefined at the
    first update (the reliability excepted) and finite, near 1, after it."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from timlab.integrations.trl import TimlabGRPOTrainer

    vocab = len(trl_setup.tok)
    bias = 0.3 * torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    trainer = TimlabGRPOTrainer(model=trl_setup.model, reward_funcs=trl_setup.reward,
                                args=grpo_args(tmp_path, 3, logging_steps=1), train_dataset=trl_setup.data,
                                processing_class=trl_setup.tok, rollout_func=hf_rollout_func(0.0, per_id=bias))
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 3 and trainer._timlab_persistence.vocab_size == trainer.model.config.vocab_size
    lag1, ema, reliability = PERSISTENCE_KEYS
    # TRL's log averages the window's values without the NaNs and writes None when none is left
    assert logs[0][lag1] is None and logs[0][ema] is None and logs[0][reliability] > 0.9
    for h in logs[1:]:
        assert all(math.isfinite(h[k]) and h[k] > 0.9 for k in PERSISTENCE_KEYS), h


def test_trl_mixin_adds_the_advantage_weighted_harm_statistics():
    """``timlab_mismatch_metrics`` on a generation batch as TRL builds it, with its (B,) advantages."""
    pytest.importorskip("trl")
    from timlab.integrations.trl import TimlabMetricsMixin

    g = torch.Generator().manual_seed(7)
    trainer_logp = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    sampling = trainer_logp - 0.05
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    batch = {"sampling_per_token_logps": sampling, "old_per_token_logps": trainer_logp, "completion_mask": mask,
             "advantages": adv}
    host = SimpleNamespace(args=SimpleNamespace(), accelerator=SimpleNamespace(num_processes=1))
    m = TimlabMetricsMixin.timlab_mismatch_metrics(host, batch)
    # r = 0.05 on every token: mean A r = 0.05 (5 - 3 + 0.5 - 1) / 11; corr(A, 0.05 x length) = corr(A, length)
    assert m["mismatch/adv_diff_mean"] == pytest.approx(0.05 * 1.5 / 11, rel=1e-9)
    lengths = torch.tensor([5.0, 3.0, 1.0, 2.0], dtype=torch.float64)
    want = float(torch.corrcoef(torch.stack([adv, lengths]))[0, 1])
    assert m["mismatch/adv_diff_corr"] == pytest.approx(want, rel=1e-9)
    del batch["advantages"]
    assert "mismatch/adv_diff_mean" not in TimlabMetricsMixin.timlab_mismatch_metrics(host, batch)


def test_trl_grpo_resume_continues_the_schedule(trl_setup, tmp_path):
    """Checkpoint at update 3 (scheduler.pt holds the replaced lambdas), resume to 6."""
    from trl import GRPOTrainer

    from timlab.integrations.trl import TimlabCallback

    def run(steps, **kw):
        trainer = GRPOTrainer(model=trl_setup.model, reward_funcs=trl_setup.reward,
                              args=grpo_args(tmp_path / "out", steps, save_strategy="steps", save_steps=3),
                              train_dataset=trl_setup.data, processing_class=trl_setup.tok,
                              callbacks=[TimlabCallback(decay_period=2)])
        trainer.train(**kw)
        return [h["train/lr"] for h in step_logs(trainer)]

    first = run(3)
    assert (tmp_path / "out" / "checkpoint-3" / "scheduler.pt").exists()
    resumed = run(6, resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    lr0 = 1e-3
    assert first + resumed[3:] == pytest.approx([lr0, lr0 / 2, lr0 / 2, lr0 / 4, lr0 / 4, lr0 / 8], rel=1e-12)
