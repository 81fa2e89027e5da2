"""The device-side decode loop (``timlab.engines.device_loop``) against the host loop.

- With the exact engine its rollouts equal the host loop's bit for bit (tokens, both log-probs,
  masks, lengths, finished flags, and the generator's state after), over ragged prompts, rows
  finishing at different steps, several bucket ladders and sync intervals, the static-buffer
  step of ``cuda_graphs`` (run eagerly on the CPU), fp32 and bf16, four samplers, three
  compaction thresholds and an MoE model; and its log-probs still equal the trainer's.
- Its batch moves down the bucket ladder as rows finish, and it stops within ``sync_every``
  steps of the last row's EOS.
- Inside the loop the host reads the device at most ceil(steps / sync_every) times, counted by
  dispatch and function modes that see every op whose result the host must wait for (a scalar
  read, a data-dependent shape, a copy to host memory); the host loop, counted the same way,
  reads it every step.
- ``bench/gpu_rollout.py --tiny`` runs on the CPU, with the roofline computed as by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from test_engines import EOS, PAD, V, tiny_model, trainer_logprobs
from timlab.engines import SamplingParams, build_engine
from timlab.engines import device_loop as dl
from timlab.engines.base import Engine
from timlab.engines.device_loop import DEFAULT_BUCKETS, DeviceLoop, bucket_for
from timlab.errors import UsageError

FIELDS = ("tokens", "key_valid", "response_mask", "logprobs", "sampling_logprobs", "lengths", "finished")
T = 20

LOOPS = {
    "k1-exact-sizes": DeviceLoop(sync_every=1, buckets=(1,)),  # no padding; every step compacts
    "k8-default": DeviceLoop(),  # 13 rows padded to 16
    "k3-4-32": DeviceLoop(sync_every=3, buckets=(4, 32)),  # padded to 32, then 4 at most
    "k5-multiples-of-6": DeviceLoop(sync_every=5, buckets=(6,)),  # 13 -> 18, 12, 6
    "k2-graphs": DeviceLoop(sync_every=2, cuda_graphs=True),  # the static-buffer step, not captured on CPU
}
SAMPLERS = {
    "t1": SamplingParams(),
    "t0.8-p0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "t1.3-k5": SamplingParams(temperature=1.3, top_k=5),
    "greedy": SamplingParams(temperature=0),
}


def _prompts(n: int = 13, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(k),), generator=g).tolist() for k in torch.randint(1, 9, (n,), generator=g)]


def _two_rollouts(engine, prompts, sampling, *, max_new_tokens: int = T):
    """Two rollouts drawn one after the other from one generator, and its state after them."""
    g = torch.Generator().manual_seed(5)
    rs = [engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, generator=g) for _ in range(2)]
    return rs, g.get_state()


def _assert_same(a, b) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _compare(model, loop, sampling, *, compact_below: float = 0.75, engine: str = "exact", prompts=None):
    prompts = prompts or _prompts()
    host = build_engine(engine, model, eos_token_id=EOS, pad_token_id=PAD)
    host.compact_below = compact_below
    dev = build_engine(engine, model, eos_token_id=EOS, pad_token_id=PAD)
    dev.compact_below, dev.device_loop = compact_below, loop
    (h1, h2), h_state = _two_rollouts(host, prompts, sampling)
    (d1, d2), d_state = _two_rollouts(dev, prompts, sampling)
    _assert_same(h1, d1)
    _assert_same(h2, d2)
    assert torch.equal(h_state, d_state)  # the generator is left where the host loop leaves it
    return d1, d2


# ------------------------------------------------------------------------------ bit for bit
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_device_loop_equals_host_loop_and_trainer(dtype, loop, sampler):
    model = tiny_model(dtype=dtype, eos_prob=0.15)
    d1, d2 = _compare(model, LOOPS[loop], SAMPLERS[sampler])
    for r in (d1, d2):
        assert r.finished.any() and len(set(r.lengths.tolist())) >= 4  # rows finish at different steps
        logp = trainer_logprobs(model, r)
        assert torch.equal(logp[r.response_mask], r.logprobs[r.response_mask])


@pytest.mark.parametrize("compact_below", (0.0, 0.37, 1.0))
@pytest.mark.parametrize("loop", ("k1-exact-sizes", "k3-4-32", "k5-multiples-of-6"))
def test_device_loop_replays_each_compaction_rule_of_the_host_loop(loop, compact_below):
    _compare(tiny_model(eos_prob=0.15), LOOPS[loop], SamplingParams(), compact_below=compact_below)


def test_device_loop_equals_host_loop_on_a_moe_model():
    model = tiny_model("qwen3_moe", eos_prob=0.15)
    d1, _ = _compare(model, DeviceLoop(sync_every=3, buckets=(4, 8, 16)), SamplingParams())
    logp = trainer_logprobs(model, d1)
    assert torch.equal(logp[d1.response_mask], d1.logprobs[d1.response_mask])


def test_fast_engine_equals_host_loop_when_the_batch_never_changes():
    """The fast mode's bits depend on the batch, so only with the host loop's batch at every step
    (no padding, no compaction): then the replayed random numbers give the same rollout."""
    _compare(tiny_model(eos_prob=0.15), DeviceLoop(sync_every=4, buckets=(13,)), SamplingParams(), compact_below=0.0,
             engine="fast")


def test_fast_engine_on_the_device_loop_is_deterministic():
    model = tiny_model(eos_prob=0.15)
    engine = build_engine("fast", model, eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop = DeviceLoop(sync_every=3, buckets=(4, 16))
    (a, _), _ = _two_rollouts(engine, _prompts(), SamplingParams())
    (b, _), _ = _two_rollouts(engine, _prompts(), SamplingParams())
    _assert_same(a, b)
    assert torch.equal(a.lengths, a.response_mask.sum(-1)) and a.finished.any()


# ------------------------------------------------------------------------------ buckets, stopping
def test_bucket_for():
    assert [bucket_for(n, (1, 2, 4)) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 12]
    assert [bucket_for(n, DEFAULT_BUCKETS) for n in (13, 128, 129, 300, 600)] == [16, 128, 256, 512, 1024]


def _decode_batches(engine, monkeypatch) -> list[int]:
    """Spy on the engine's decode calls: the batch size of each."""
    sizes = []
    real = engine._decode_ids

    def spy(state, ids, col):
        sizes.append(ids.shape[0])
        return real(state, ids, col)

    monkeypatch.setattr(engine, "_decode_ids", spy)
    return sizes


@pytest.mark.parametrize("compact_below", (0.75, 0.0))
def test_batch_moves_down_the_buckets_as_rows_finish(monkeypatch, compact_below):
    engine = build_engine("exact", tiny_model(eos_prob=0.15), eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop, engine.compact_below = DeviceLoop(sync_every=2, buckets=(4, 8, 16)), compact_below
    sizes = _decode_batches(engine, monkeypatch)
    r = engine.generate(_prompts(), max_new_tokens=T, generator=torch.Generator().manual_seed(5))
    assert len(sizes) == T - 1
    if compact_below == 0:
        assert set(sizes) == {16}  # 13 rows padded to 16, all kept
        return
    assert sizes == sorted(sizes, reverse=True) and set(sizes) <= {4, 8, 16} and sizes[-1] < 16
    for i, n in enumerate(sizes):  # sizes[i]: the decode call after step i (0-based)
        live = int((r.lengths > i + 1).sum())  # rows still generating after step i
        assert n >= live
        if i > 0 and n != sizes[i - 1]:  # a move only at a host read, after steps 1, 3, 5, ...
            assert (i + 1) % 2 == 0 and n == bucket_for(live, (4, 8, 16))
    assert len(set(sizes)) == 3


@pytest.mark.parametrize("sync_every", (1, 3, 8))
def test_loop_stops_within_sync_every_steps_of_the_last_eos(monkeypatch, sync_every):
    model = tiny_model(eos_prob=0.5)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop = DeviceLoop(sync_every=sync_every)
    sizes = _decode_batches(engine, monkeypatch)
    prompts = _prompts()
    r = engine.generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(5))
    assert r.finished.all()
    last = int(r.lengths.max())  # the last EOS is sampled at step last - 1
    assert len(sizes) == math.ceil(last / sync_every) * sync_every - 1 < 40 - 1
    host = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    _assert_same(r, host.generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(5)))


# ------------------------------------------------------------------------------ host reads
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
"""Ops the host must wait for on a GPU: a scalar read (``item``, ``bool``, ``int``) or an output
whose shape depends on the data."""
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
"""Indexing ops, which wait for the host when an index is a boolean mask (a data-dependent shape)."""
HOST_COPIES = {"tolist", "numpy", "cpu"}
"""Tensor methods that copy to host memory (on the CPU they reach no dispatched op)."""


class HostReads(TorchDispatchMode):
    """Records each op that would make the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.events.append(name)
        elif name in INDEX_OPS and any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            self.events.append(f"{name}[bool]")
        elif name == "repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            self.events.append(name)
        return func(*args, **kwargs)


class HostCopies(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_COPIES:
            self.reads.events.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _counting(fn, into: list):
    def counted(*args, **kwargs):
        reads = HostReads()
        with HostCopies(reads), reads:
            out = fn(*args, **kwargs)
        into.append(reads.events)
        return out
    return counted


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.tensor([1.0, 0.0, 2.0])
    events = []

    def reads():
        x.sum().item(), bool(x.sum()), int(x[0]), x.tolist(), x[x > 0], x.nonzero(), x.cpu(), torch.unique(x)
        torch.repeat_interleave(x, torch.tensor([1, 2, 0]))
        y = x.clone()
        y[x > 0] = 0.0
        torch.repeat_interleave(x, 2), x[torch.tensor([0, 2])], x * 2  # these do not read the host
    _counting(reads, events)()
    assert sorted(events[0]) == sorted(["_local_scalar_dense"] * 3 + ["tolist", "index[bool]", "nonzero", "cpu",
                                        "_unique2", "repeat_interleave", "index_put_[bool]"])


@pytest.mark.parametrize("loop", [DeviceLoop(sync_every=1, buckets=(4, 8, 16)), DeviceLoop(sync_every=4),
                                  DeviceLoop(sync_every=7, buckets=(2, 4, 8, 16)),
                                  DeviceLoop(sync_every=3, buckets=(4, 16), cuda_graphs=True)],
                         ids=("k1", "k4", "k7", "k3-graphs"))
@pytest.mark.parametrize("sampler", ("t0.8-p0.9", "greedy"))
def test_device_loop_reads_the_host_at_most_once_per_sync_every_steps(monkeypatch, loop, sampler):
    engine = build_engine("exact", tiny_model(eos_prob=0.15), eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop = loop
    loops = []
    monkeypatch.setattr(dl, "decode_loop", _counting(dl.decode_loop, loops))
    r = engine.generate(_prompts(), max_new_tokens=T, sampling=SAMPLERS[sampler],
                        generator=torch.Generator().manual_seed(5))
    assert r.finished.any() and not r.finished.all()  # rows left the batch; the loop ran all T steps
    assert len(loops) == 1
    assert loops[0] == ["nonzero"] * ((T - 1) // loop.sync_every)  # the reads every sync_every steps, no other
    assert len(loops[0]) <= math.ceil(T / loop.sync_every)

    host = build_engine("exact", engine.model, eos_token_id=EOS, pad_token_id=PAD)  # the same counter on the host loop
    host_loops = []
    monkeypatch.setattr(Engine, "_generate", _counting(Engine._generate, host_loops))
    host.generate(_prompts(), max_new_tokens=T, sampling=SAMPLERS[sampler], generator=torch.Generator().manual_seed(5))
    assert host_loops[0].count("_local_scalar_dense") >= T - 1  # one read per step


# ------------------------------------------------------------------------------ graphs, settings, fallbacks
def test_graph_steps_skip_the_capture_on_cpu_and_keep_their_buffers():
    model = tiny_model(eos_prob=0.15)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop = DeviceLoop(sync_every=2, buckets=(4, 8, 16), cuda_graphs=True)
    r1 = engine.generate(_prompts(), max_new_tokens=T, generator=torch.Generator().manual_seed(5))
    steps = dict(engine._graphed_steps.steps)
    assert {rows for rows, _ in steps} == {4, 8, 16} and {S for _, S in steps} == {r1.tokens.shape[1]}
    assert all(s.graph is None and not s.capture for s in steps.values())
    engine.generate(_prompts(), max_new_tokens=T, generator=torch.Generator().manual_seed(5))
    assert all(engine._graphed_steps.steps[k] is v for k, v in steps.items())  # the same static buffers
    model.to(torch.bfloat16)  # new parameter storage: new buffers
    engine.generate(_prompts(), max_new_tokens=T, generator=torch.Generator().manual_seed(5))
    assert not any(engine._graphed_steps.steps.get(k) is v for k, v in steps.items())


@pytest.mark.parametrize("kwargs, field", [
    (dict(sync_every=0), "device_loop.sync_every"), (dict(sync_every=1.5), "device_loop.sync_every"),
    (dict(sync_every=True), "device_loop.sync_every"), (dict(buckets=()), "device_loop.buckets"),
    (dict(buckets=(8, 4)), "device_loop.buckets"), (dict(buckets=(4, 4)), "device_loop.buckets"),
    (dict(buckets=(0, 4)), "device_loop.buckets"),
])
def test_bad_settings_are_one_line_errors(kwargs, field):
    with pytest.raises(UsageError, match=field) as e:
        DeviceLoop(**kwargs)
    assert "\n" not in str(e.value)


def test_logits_processor_and_routing_record_take_the_host_loop(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the device loop ran")

    monkeypatch.setattr(dl, "generate", refuse)
    model = tiny_model("qwen3_moe", eos_prob=0.15)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    engine.device_loop = DeviceLoop()
    engine.generate(_prompts(), max_new_tokens=6, logits_processor=lambda logits, col: logits + 0.5)
    r = engine.generate(_prompts(), max_new_tokens=6, record_routing=True)
    assert r.experts is not None
    with pytest.raises(AssertionError, match="device loop ran"):
        engine.generate(_prompts(), max_new_tokens=6)


# ------------------------------------------------------------------------------ the benchmark, tiny
def test_gpu_rollout_bench_runs_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    import importlib.util
    import json

    from script_loader import REPO

    spec = importlib.util.spec_from_file_location("gpu_rollout", REPO / "bench" / "gpu_rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--tiny", "--batches", "4", "--variants", "exact,exact+graphs,fast+loop,hf", "--repeats", "1",
                      "--bandwidth", "10", "--json", str(tmp_path / "r.json")])
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["exact", "exact+graphs", "fast+loop", "hf"] and out["device_name"] == "cpu"
    assert all(r["tokens"] == 4 * 8 for r in rows.values())  # EOS disabled: every row generates 8 tokens
    assert rows["exact"]["bitwise_equal_share"] == rows["exact+graphs"]["bitwise_equal_share"] == 1.0
    # the roofline by hand: the weights once (tied embedding: 512 x 64; per layer q, o 64 x 64, k, v
    # 64 x 32, q/k norms 16 each, MLP 3 x 64 x 128, two norms 64; the final norm 64), bf16, plus the
    # exact path's whole KV buffer: B x layers x (K, V) x KV heads x head_dim x 2 bytes per column
    weights = 2 * (512 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 3 * 64 * 128 + 2 * 64) + 64)
    assert weights == 2 * 106_880
    S = rows["exact"]["buffer_len"]
    assert rows["exact"]["roofline_tokens_per_s"] == pytest.approx(4 * 10e9 / (weights + 4 * 2 * 2 * 2 * 16 * 2 * S))
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 4


@pytest.mark.parametrize("loop", ["device", "graphs"])
def test_training_on_the_device_loop_repeats_the_host_loop_bit_for_bit(tmp_path, loop, device_loop_calls):
    """`rollout.decode_loop`: on the CPU a training run on the device loop (rollouts and evaluations)
    logs the metrics of the same run on the host loop, bit for bit (timings aside), with a mismatch
    injected (an fp16 copy of the weights) so the rollout is not the trainer's own."""
    import pandas as pd

    calls = device_loop_calls

    from timlab.config import resolve
    from timlab.rundir.metrics_log import without_timings
    from timlab.trainer.run import train

    def run(choice: str) -> pd.DataFrame:
        cfg = resolve(preset="smoke", overrides=[
            "run.steps=3", "run.eval_every=3", "run.checkpoint_every=3", "mismatch.injector=precision",
            "mismatch.dtype=float16", f"rollout.decode_loop={choice}", "rollout.sync_every=3"])
        train(cfg, tmp_path / choice)
        return without_timings(pd.read_parquet(tmp_path / choice / "metrics.parquet"))

    host = run("host")
    assert not calls
    other = run(loop)
    # the rollouts and evaluations went through the device loop, not the host loop's fallback
    assert calls and set(calls) == {DeviceLoop(sync_every=3, cuda_graphs=loop == "graphs")}
    assert (host["mismatch/max_abs_diff"].dropna() > 0).any()  # the rollout is not the trainer's
    assert len(host) == 4 and host["val/accuracy"].notna().sum() == 2
    pd.testing.assert_frame_equal(host, other)


def test_decode_loop_settings_are_checked_with_the_config():
    from timlab.config import ConfigError, resolve, validate

    with pytest.raises(ConfigError, match=r"unknown rollout.decode_loop 'gpu'; valid choices: host, device, graphs"):
        validate(resolve(preset="smoke", overrides=["rollout.decode_loop=gpu"]))
    with pytest.raises(ConfigError, match=r"rollout.decode_loop device needs a native engine; rollout.engine is 'hf'"):
        validate(resolve(preset="smoke", overrides=["rollout.decode_loop=device", "rollout.engine=hf"]))
    with pytest.raises(ConfigError, match=r"rollout.sync_every must be >= 1, got 0"):
        resolve(preset="smoke", overrides=["rollout.sync_every=0"])
    cfg = resolve(preset="smoke")
    assert cfg.hash() == resolve(preset="smoke", overrides=["rollout.decode_loop=host", "rollout.sync_every=8"]).hash()
    assert cfg.hash() != resolve(preset="smoke", overrides=["rollout.decode_loop=graphs"]).hash()
