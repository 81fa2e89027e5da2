"""Write a tiny random-weight Qwen3 chat model folder with transformers, for trying the dataset task.

The folder is what a real one looks like, only small: ``config.json`` + ``model.safetensors``
written by ``transformers`` (Qwen3, 2 layers, hidden 32, untied head), a byte-level BPE
``tokenizer.json`` trained with the ``tokenizers`` library on the bundled word problems, and a
ChatML chat template (``<|im_start|>role ... <|im_end|>``; EOS ``<|im_end|>``, as in Qwen).
Nothing is downloaded. The LM head's EOS row is shifted along the mean final hidden state so a
random model ends a reply with probability about ``eos_prob`` per token (a random model
otherwise almost never stops, and an RL step on replies that never end has nothing to learn).

    python scripts/make_tiny_chat_model.py /tmp/tiny-qwen3
    timlab train --run-dir runs/wp --set model.path=/tmp/tiny-qwen3 --set task.name=dataset ...

tests/test_dataset_task.py builds its model with ``make_tiny_chat_model``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "timlab" / "data" / "word_problems.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's ChatML layout, without its tool-call and thinking branches."""


def train_bpe(texts: list[str], vocab_size: int = 384):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 / Qwen style) with the ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def make_tiny_chat_model(out: str | Path, *, seed: int = 0, eos_prob: float = 0.1, hidden_size: int = 32,
                         num_layers: int = 2, vocab_size: int = 384, max_position_embeddings: int = 1024) -> Path:
    """Write the folder; returns its path. Same arguments, same bytes."""
    import transformers

    out = Path(out)
    texts = [json.loads(line)["question"] for line in DATA.read_text(encoding="utf-8").splitlines()]
    texts += [" ".join(str(n) for n in range(i, i + 50)) for i in range(0, 1000, 50)]  # numbers
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, vocab_size), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML, model_max_length=max_position_embeddings)
    tok.save_pretrained(str(out))
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        _make_eos_likely(model, tok.eos_token_id, eos_prob, torch.Generator().manual_seed(seed))
    model.save_pretrained(str(out))
    return out


def _make_eos_likely(model, eos: int, target: float, g: torch.Generator) -> None:
    """Bisect a shift of the EOS row along the mean final hidden state to hit ``target`` mean p(EOS)."""
    V = model.config.vocab_size
    tokens = torch.randint(len(SPECIALS), V, (8, 32), generator=g)  # (B, S)
    h = model.model(input_ids=tokens).last_hidden_state.reshape(-1, model.config.hidden_size)  # (N, hidden)
    u = h.mean(0) / h.mean(0).norm()
    w = model.lm_head.weight
    base = w[eos].clone()
    lo, hi = -100.0, 100.0
    for _ in range(50):
        beta = (lo + hi) / 2
        w[eos] = base + beta * u
        p_eos = torch.softmax(h @ w.T, -1)[:, eos].mean()
        lo, hi = (beta, hi) if p_eos < target else (lo, beta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to write (created)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eos-prob", type=float, default=0.1, help="mean probability of ending a reply per token")
    args = ap.parse_args()
    print(make_tiny_chat_model(args.out, seed=args.seed, eos_prob=args.eos_prob))


if __name__ == "__main__":
    main()
