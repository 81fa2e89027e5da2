"""timlab.model.chunked_attention and the fast mode's shared SDPA mask: the trainer's step computed
faster with the bits it had.

The reference is the op-by-op computation the library keeps for other dtypes (``ops.CHUNKED_DTYPES``
emptied) and SDPA's own conversion of the bool mask (``llama._sdpa_mask`` bypassed). Bits are
compared as int32 patterns, so even the sign of a zero must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from timlab.model import chunked_attention, llama, ops
from timlab.model.forward import attention_mask, buffer_length, teacher_forced_batch, token_logprobs
from timlab.model.llama import CausalLM, ModelConfig, random_init_
from timlab.trainer.losses import ppo_clip_loss


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _attention_case(B, H, H_kv, D, L, S, seed=0):
    """Teacher-forced q (B, H, L, D) and the zero-padded k, v buffers (B, H_kv, S, D) as the model
    makes them (views of (B, L, heads, D) projections), rows with left padding, an output gradient."""
    g = torch.Generator().manual_seed(seed)
    key_valid = torch.ones(B, L, dtype=torch.bool)
    key_valid[0, : L // 3] = False
    key_valid[-1, : L // 5] = False
    leaves = [torch.randn(B, L, h, D, generator=g).requires_grad_() for h in (H, H_kv, H_kv)]
    grad_out = torch.randn(B, H, L, D, generator=g)
    return key_valid, leaves, grad_out


def _attention_run(key_valid, leaves, grad_out, S):
    q, k, v = (t.transpose(1, 2) * 1.0 for t in leaves)  # (B, h, L, D), non-leaf like the model's
    k, v = (F.pad(t, (0, 0, 0, S - t.shape[2])) for t in (k, v))  # (B, H_kv, S, D)
    out = ops.fixed_length_attention(q, k, v, attention_mask(key_valid, 0, key_valid.shape[1], S),
                                     q.shape[-1] ** -0.5, start=0, cache={})
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads]


@pytest.mark.parametrize("B, H, H_kv, D, L, S", [
    (3, 4, 2, 16, 40, 48),    # last block short of the buffer (K < S)
    (3, 4, 2, 16, 48, 48),    # last block sees all S keys (the transposed key-gradient sum)
    (2, 2, 2, 8, 33, 48),     # one query in the last block: 1 row padded to ATTN_MIN_ROWS
    (4, 8, 2, 16, 130, 144),
    (3, 6, 3, 32, 200, 256),
])
@pytest.mark.parametrize("chunk_elements", [1, 5000])  # one sequence per chunk, a few
def test_chunked_attention_has_the_op_by_op_bits(monkeypatch, B, H, H_kv, D, L, S, chunk_elements):
    case = _attention_case(B, H, H_kv, D, L, S)
    with monkeypatch.context() as m:
        m.setattr(ops, "CHUNKED_DTYPES", ())
        ref = _attention_run(*case, S)
    if chunk_elements is not None:
        monkeypatch.setattr(chunked_attention, "CHUNK_ELEMENTS", chunk_elements)
    got = _attention_run(*case, S)
    for name, r, x in zip(("out", "grad q", "grad k", "grad v"), ref, got):
        assert torch.equal(_bits(r), _bits(x)), name


def test_chunked_attention_keeps_only_its_inputs_for_the_backward(monkeypatch):
    """Autograd keeps q, k, v and the mask (4.1 MB here) instead of every block's probabilities and
    the other tensors the op-by-op graph saves (34.0 MB)."""
    B, H, H_kv, D, L, S = 16, 4, 2, 16, 300, 320  # scores of 10 sequences a chunk: 2 chunks
    key_valid, leaves, _ = _attention_case(B, H, H_kv, D, L, S)

    def saved_bytes() -> int:
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            q, k, v = (t.transpose(1, 2).contiguous() for t in leaves)
            k, v = (F.pad(t, (0, 0, 0, S - L)) for t in (k, v))
            total.clear()  # only what the attention itself saves
            ops.fixed_length_attention(q, k, v, attention_mask(key_valid, 0, L, S), 0.25, start=0, cache={})
        return sum(total)

    inputs = B * H * L * D * 4 + 2 * B * H_kv * S * D * 4 + B * L * S  # q, k, v fp32 and the bool mask
    assert saved_bytes() == inputs
    with monkeypatch.context() as m:
        m.setattr(ops, "CHUNKED_DTYPES", ())
        assert saved_bytes() > 6 * inputs  # 34.0 MB: every block's probabilities, padded queries, ...


def _model() -> CausalLM:
    """The surge preset's policy shape (hidden 64, 3 layers, 4 heads over 2 KV heads, MLP 192)."""
    cfg = ModelConfig(vocab_size=24, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return random_init_(CausalLM(cfg), torch.Generator().manual_seed(0), std=0.1)


def _batch(B: int, answer: int, seed: int = 1):
    """B prompts of 5-12 tokens (left-padded) and answers of answer/2 .. answer tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 13, (B,), generator=g).tolist()
    answers = torch.randint(answer // 2, answer + 1, (B,), generator=g).tolist()
    answers[0] = answer
    prompts = [torch.randint(1, 24, (n,), generator=g).tolist() for n in lens]
    completions = [torch.randint(1, 24, (n,), generator=g).tolist() for n in answers]
    tokens, key_valid, mask = teacher_forced_batch(prompts, completions, pad_token_id=0)
    return tokens, key_valid, mask, buffer_length(max(lens), answer + 8)


def _rl_step(tokens, key_valid, mask, kv_len):
    """The trainer's exact-mode loss and backward (``Trainer._score`` / ``_update`` at one update)."""
    model = _model()
    logp, entropy = token_logprobs(model, tokens, key_valid, mode="exact", with_entropy=True, kv_len=kv_len,
                                   score_mask=mask)
    adv = torch.linspace(-1.0, 1.0, tokens.shape[0])
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, mask.float(), denom=float(mask.sum()))
    loss.backward()
    return [loss.detach(), logp.detach(), entropy] + [p.grad for p in model.parameters()]


def _sft_step(tokens, key_valid, mask):
    """``timlab.trainer.pretrain.sft_update``'s loss and backward (fast mode)."""
    model = _model()
    logp, _ = token_logprobs(model, tokens, key_valid, mode="fast")
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    return [loss.detach(), logp.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("B, answer", [(8, 300), (16, 24), (16, 36)])
def test_train_steps_have_the_bits_they_had(monkeypatch, B, answer):
    """Loss, log-probs, entropy and every parameter's gradient of an RL step (exact mode) and an SFT
    step (fast mode), at T ~ 300 and two short answers, against the computation before the change."""
    tokens, key_valid, mask, kv_len = _batch(B, answer)
    with monkeypatch.context() as m:
        m.setattr(ops, "CHUNKED_DTYPES", ())
        m.setattr(llama, "_sdpa_mask", lambda step, q: step.allowed)  # SDPA converts the bool mask per layer
        ref_rl, ref_sft = _rl_step(tokens, key_valid, mask, kv_len), _sft_step(tokens, key_valid, mask)
    monkeypatch.setattr(chunked_attention, "CHUNK_ELEMENTS", 1 << 13)  # 1-2 sequences a chunk at these lengths
    rl, sft = _rl_step(tokens, key_valid, mask, kv_len), _sft_step(tokens, key_valid, mask)
    assert len(rl) == 3 + 30 and len(sft) == 2 + 30  # the 30 parameter tensors
    for i, (r, x) in enumerate(zip(ref_rl + ref_sft, rl + sft)):
        assert torch.equal(r, x) and torch.equal(_bits(r), _bits(x)), i
    assert float(ref_rl[0]) != 0.0 and all(float(g.abs().sum()) > 0 for g in rl[3:])  # nothing trivially zero


def test_fast_mode_builds_one_additive_mask_per_forward(monkeypatch):
    """The layers share one (B, 1, L, L) 0 / -inf mask, the values SDPA makes of the bool mask."""
    tokens, key_valid, _, _ = _batch(4, 30)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    token_logprobs(_model(), tokens, key_valid, mode="fast")
    assert len(seen) == 3 and all(m is seen[0] for m in seen)
    allowed = attention_mask(key_valid, 0, tokens.shape[1])
    assert seen[0].dtype == torch.float32 and seen[0].shape == allowed.shape
    assert torch.equal(seen[0], torch.where(allowed, 0.0, float("-inf")))
