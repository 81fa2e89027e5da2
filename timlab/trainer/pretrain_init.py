"""``model.pretrain_init``: the SFT warm start continues from a model folder instead of a random init.

A length curriculum is two warm starts: SFT on short answers, then SFT on long answers starting
from the first model (docs/install.md, "The model cache"). Used in ``timlab.trainer.pretrain``:
``init_digest`` goes into the warm start's cache key and its ``pretrain.json``, and ``load_init``
copies the folder's weights into the freshly built model. ``config.check_warm_start`` calls
``check_pretrain_init``, which refuses a folder whose architecture or vocabulary is not the warm
start's, so a bad folder fails before any work. Everything else of the SFT (steps, batches, LR
schedule) is as from a random init.

The key holds the SHA-256 of the weight files, not the path: two different inits never share a
cached warm start, and a folder moved or copied elsewhere keeps its key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers

from timlab.errors import TimlabError, UsageError, one_line
from timlab.files import sha256_file
from timlab.model.hf_io import config_from_hf, load_model, weight_files
from timlab.model.llama import CausalLM, ModelConfig
from timlab.tokenizer import build_char_tokenizer
from timlab.trainer.architecture import CONFIG_KEYS, model_config_for

if TYPE_CHECKING:
    from timlab.config import Config
    from timlab.tasks import Task

KEY = "model.pretrain_init"

FREE_FIELDS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
"""ModelConfig fields an init may differ in: RoPE has no weights (the warm start takes the longest
context its task needs), and the special tokens' ids are the warm start's tokenizer's."""


def _folder(path: str) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise UsageError(f"{KEY} {path}: no such folder")
    if not folder.is_dir():
        raise UsageError(f"{KEY} {path}: not a folder (give a model folder written by `timlab pretrain --out`, "
                         "`timlab export` or save_pretrained)")
    return folder


def init_digest(path: str) -> dict[str, str]:
    """``{file name: SHA-256}`` of the weight files in the init folder ``path`` (a single
    ``model.safetensors`` in the usual case: its ``sha256sum``)."""
    folder = _folder(path)
    try:
        files = weight_files(folder)
    except TimlabError as e:
        raise UsageError(f"{KEY} {path}: {one_line(e).removeprefix(f'{folder}: ')}") from None
    return {f.name: sha256_file(f) for f in files}


def init_record(path: str) -> dict:
    """What a warm start's ``pretrain.json`` says about its init: the path as given, the SHA-256 of
    each weight file, and, when the init is itself a timlab warm start, its key and task."""
    record: dict = {"path": path, "sha256": init_digest(path)}
    info = Path(path) / "pretrain.json"
    try:
        parent = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else None
    except (OSError, ValueError):
        parent = None
    if isinstance(parent, dict):
        keep = ("key", "task", "task_kwargs", "val_accuracy", "init")  # a chain of inits records each link
        record["pretrain"] = {k: parent[k] for k in keep if k in parent}
    return record


def _init_config(folder: Path, path: str) -> ModelConfig:
    file = folder / "config.json"
    if not file.is_file():
        raise UsageError(f"{KEY} {path}: no config.json (not a model folder)")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(hf, dict):
            raise ValueError("not a JSON object")
        return config_from_hf(hf)
    except (ValueError, RecursionError) as e:  # bad JSON, or a config the model does not implement
        raise UsageError(f"{KEY} {path}: config.json: {one_line(e)}") from None


def check_pretrain_init(cfg: Config, task: Task) -> None:
    """One-line errors naming ``model.pretrain_init`` unless it is a model folder with the warm
    start's architecture and ``task``'s alphabet (called by ``config.check_warm_start``)."""
    vocab = build_char_tokenizer(task.alphabet).get_vocab(with_added_tokens=True)
    check_init(cfg.model.pretrain_init, model_config_for(cfg, len(vocab), None, 1), vocab, names=CONFIG_KEYS,
               alphabet=f"task {cfg.task.name!r}'s alphabet")


def check_init(path: str, want: ModelConfig, vocab: dict[str, int], *, names: dict[str, str], alphabet: str) -> None:
    """One-line errors unless the folder ``path`` holds weights of the architecture ``want`` (every
    field but ``FREE_FIELDS``) for the token ids ``vocab``. ``names`` maps a ModelConfig field to the
    config key that sets it (``num_hidden_layers`` -> ``model.num_layers``); ``alphabet`` names
    where ``vocab`` comes from (``task 'scratch_add''s alphabet``)."""
    init_digest(path)  # the folder and its weight files exist
    got = _init_config(Path(path), path)
    for f in dataclasses.fields(ModelConfig):
        if f.name in FREE_FIELDS:
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "head_dim":
            a, b = got.dim_per_head, want.dim_per_head
        if a == b:
            continue
        if f.name == "vocab_size":
            raise UsageError(f"{KEY} {path}: vocab_size={a} in its config.json, but {alphabet} gives {b} tokens "
                             "(its characters and 4 special tokens)")
        where = f"the config's {names[f.name]}" if f.name in names else "the warm start's"
        raise UsageError(f"{KEY} {path}: {f.name}={a!r} in its config.json, but {where} is {b!r}; "
                         "the init must have the warm start's architecture")
    tok_file = Path(path) / "tokenizer.json"
    if tok_file.is_file():  # a folder without one (save_pretrained of a model alone): the ids are taken as given
        try:
            theirs = tokenizers.Tokenizer.from_file(str(tok_file)).get_vocab(with_added_tokens=True)
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise UsageError(f"{KEY} {path}: tokenizer.json: unreadable "
                             f"({one_line(e, with_type=True)[:200]})") from None
        for token in sorted(set(vocab) | set(theirs), key=lambda t: (vocab.get(t, len(vocab)), t)):
            if vocab.get(token) != theirs.get(token):
                show = lambda i: "absent" if i is None else f"id {i}"  # noqa: E731
                raise UsageError(f"{KEY} {path}: its tokenizer differs from {alphabet}: {token!r} is "
                                 f"{show(theirs.get(token))} there, {show(vocab.get(token))} here")


def load_init(model: CausalLM, path: str) -> None:
    """Copy the weights of the init folder ``path`` (checked by ``check_init``) into ``model``."""
    init = load_model(path)
    model.load_state_dict(init.state_dict(), strict=True)


__all__ = ["init_digest", "init_record", "check_pretrain_init", "check_init", "load_init"]
