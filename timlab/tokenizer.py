"""Tokenizers: a character-level tokenizer for the synthetic tasks, and one loader for any folder.

The tiny models in timlab read one token per character, so a response of N characters is N
tokens and response length is a clean signal. ``build_char_tokenizer`` makes that tokenizer with
the HF ``tokenizers`` library and ``save_char_tokenizer`` writes it as an ordinary HF tokenizer
folder (loadable by ``transformers.AutoTokenizer``), so models trained here can be served by
HF / vLLM unchanged.

``load_tokenizer`` returns a small ``Tokenizer`` wrapper around a ``tokenizers.Tokenizer``. It
always prefers a folder's ``tokenizer.json``: for a Qwen2 model folder ``AutoTokenizer`` builds a
``Qwen2Tokenizer`` from vocab/merges and silently drops the spaces of a char-level vocab. Only
when there is no ``tokenizer.json`` does it fall back to ``transformers.AutoTokenizer`` (an
optional dependency, imported only there) and wrap that tokenizer's fast backend.

A folder's chat template (``chat_template`` in ``tokenizer_config.json``, or a
``chat_template.jinja`` file) is kept on the wrapper: ``Tokenizer.render_chat(messages)`` applies
it through ``transformers`` (the template is Jinja with HF's own helpers and special-token
variables), and without one joins the messages' contents with a blank line (``PLAIN_CHAT_SEP``).
A folder's template is code from the folder: transformers runs it in Jinja's sandbox, which blocks
escapes and caps one ``range()`` at 100,000 items but not nested loops (``range(99999)`` inside
``range(99999)`` would run 10^10 times). So each render has a work budget: at most
``TEMPLATE_MAX_LINES`` lines of template code (the template's own and Jinja's filters and runtime),
``TEMPLATE_MAX_SECONDS`` of wall time (a backstop for lines that each do much work inside C) and
``TEMPLATE_MAX_CHARS`` characters of output (counted as the template yields it, so a prompt the
tokenizer could not take is never built whole); past any of them it stops with a one-line error. The line count is the same on every machine. For a
3,000-character chat, the chat templates TRL ships run 100 to 2,000 lines, and the few that walk
the text character by character (SmolVLM's, Idefics3's) up to about 25 lines per character.

Special token ids of the char tokenizer: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3,
then the sorted unique characters from 4 on. Text containing the literal string ``<eos>`` (etc.)
is encoded as that special token, as in every HF tokenizer; the task alphabets contain no ``<``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from timlab.errors import BadFileError, UsageError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in the char tokenizer
PLAIN_CHAT_SEP = "\n\n"
"""Without a chat template, ``render_chat`` joins the messages' contents (system prompt, then the
user's prompt) with this, and adds no role markers or generation cue."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template
TEMPLATE_MAX_LINES = 10_000_000
"""Lines of template code one chat-template render may run (see the module docstring for what
ordinary templates use)."""
TEMPLATE_MAX_SECONDS = 10.0
"""Wall-clock seconds one chat-template render may take (an ordinary one: under a millisecond)."""
TEMPLATE_MAX_CHARS = 1 << 19
"""Characters one chat-template render may produce (524,288: four times a dataset field's limit of
131,072, room for a system prompt and a prompt at that limit and the template's own text). A
template can print far more within its line budget (``{{ "x" * 3000 }}`` in a loop), and a
tokenizer handed 3e8 characters aborts the process in native code."""


class TemplateBudgetError(UsageError):
    """A chat template ran past its work budget (``TEMPLATE_MAX_LINES``, ``TEMPLATE_MAX_SECONDS``,
    ``TEMPLATE_MAX_CHARS``)."""


@contextlib.contextmanager
def template_budget(max_lines: int | None = None, max_seconds: float | None = None, max_chars: int | None = None):
    """Bound the Jinja code run inside the block: every line of a template's compiled code and of
    Jinja's own modules (its filters, runtime and sandbox) counts, and past ``max_lines`` lines,
    ``max_seconds`` (checked every 1,000 lines) or ``max_chars`` characters of text yielded by the
    template's own code (its output, chunk by chunk; None: ``TEMPLATE_MAX_LINES``,
    ``TEMPLATE_MAX_SECONDS``, ``TEMPLATE_MAX_CHARS``) a ``TemplateBudgetError`` is raised inside
    the template. A trace function of this thread only; the one in place before (a debugger,
    coverage) is suspended while the block runs and put back afterwards."""
    import jinja2

    max_lines = TEMPLATE_MAX_LINES if max_lines is None else max_lines
    max_seconds = TEMPLATE_MAX_SECONDS if max_seconds is None else max_seconds
    max_chars = TEMPLATE_MAX_CHARS if max_chars is None else max_chars
    jinja_dir = str(Path(jinja2.__file__).parent)
    deadline = time.monotonic() + max_seconds
    lines = chars = 0

    def count(frame, event, arg):
        nonlocal lines, chars
        if event == "return" and isinstance(arg, str) and frame.f_code.co_filename == "<template>":
            chars += len(arg)  # a chunk the template yields (or a macro returns): its output
        elif event == "line":
            if chars > max_chars:  # raised at a line, inside the template (from a "return" it is lost)
                raise TemplateBudgetError(f"more than {max_chars:,} characters of output")
            lines += 1
            if lines > max_lines:
                raise TemplateBudgetError(f"more than {max_lines:,} lines of template code")
            if lines % 1000 == 0 and time.monotonic() > deadline:
                raise TemplateBudgetError(f"more than {max_seconds:g} s")
        return count

    def enter(frame, event, arg):  # a new frame: trace its lines only if it is Jinja's code
        name = frame.f_code.co_filename
        return count if name == "<template>" or name.startswith(jinja_dir) else None

    before = sys.gettrace()
    sys.settrace(enter)
    try:
        yield
    finally:
        sys.settrace(before)


def build_char_tokenizer(chars: str) -> tokenizers.Tokenizer:
    """One token per character of ``chars`` (duplicates ignored, spaces kept), after 4 specials."""
    if not chars:
        raise UsageError("build_char_tokenizer needs at least one character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(set(chars)):
        vocab[ch] = len(vocab)
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # every single character (whitespace and newlines included) is its own pre-token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate tokens: no spaces inserted on decode
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocab: keeps ids 0..3
    return tok


def save_char_tokenizer(chars: str, out_dir: str | Path, *, model_max_length: int = 1024) -> Path:
    """Write the char tokenizer as an HF tokenizer folder; returns the folder.

    Files: ``tokenizer.json``, ``tokenizer_config.json`` (``PreTrainedTokenizerFast``) and
    ``special_tokens_map.json``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(chars)
    tok.save(str(out / "tokenizer.json"))
    special = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


class Tokenizer:
    """The interface the rest of timlab uses, over a ``tokenizers.Tokenizer``.

    ``encode`` adds no special tokens; ``pad_token_id`` falls back to ``eos_token_id``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_id: int,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        name_or_path: str = "",
        folder: str | Path | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.folder = None if folder is None else Path(folder)
        self.chat_template = chat_template
        self._hf = None  # the transformers tokenizer that renders chat_template, loaded on first use
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self.bos_token_id = bos_token_id
        self.name_or_path = name_or_path

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials and added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def batch_encode(self, texts: Iterable[str]) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """``[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`` -> the prompt
        text up to where the assistant's reply starts: the folder's chat template applied by
        ``transformers`` (``add_generation_prompt=True``), or without a template the contents
        joined by ``PLAIN_CHAT_SEP``."""
        if self.chat_template is None:
            return PLAIN_CHAT_SEP.join(m["content"] for m in messages)
        if self._hf is None:
            self._hf = _hf_tokenizer(self.folder, "to apply its chat template")
        try:
            with template_budget():
                text = self._hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            if len(text) > TEMPLATE_MAX_CHARS:  # output the count above did not see; never to the tokenizer
                raise TemplateBudgetError(f"more than {TEMPLATE_MAX_CHARS:,} characters of output")
            return text
        except TemplateBudgetError as e:
            why = "a prompt too long to tokenize" if "characters" in str(e) else "nested loops?"
            raise TemplateBudgetError(f"the chat template of {str(self.folder)!r} ran past its work budget ({e}) "
                                      f"rendering one prompt: {why}") from None
        except Exception as e:  # jinja2 raises its own types from a user's template; keep it one line
            raise UsageError(f"the chat template of {str(self.folder)!r} failed to render "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token_id}, pad={self.pad_token_id}, bos={self.bos_token_id})")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer folder (or a ``tokenizer.json`` file) into a timlab ``Tokenizer``."""
    p = Path(path)
    if p.is_file() and p.name.endswith(".json"):
        folder, tok_file = p.parent, p
    elif p.is_dir():
        folder, tok_file = p, p / "tokenizer.json"
    else:
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} does not exist; expected a folder with tokenizer.json")
    if tok_file.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise BadFileError(f"{tok_file}: not a tokenizers JSON file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return _wrap(backend, _special_tokens(folder), folder, str(path))
    return _load_with_transformers(folder, str(path))


def _hf_tokenizer(folder: Path | None, why: str):
    """``transformers.AutoTokenizer`` for ``folder`` (local files only), or a one-line error."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f"{str(folder)!r}: transformers is needed {why} (pip install 'timlab[hf]')") from None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many types; keep the message one line
        raise UsageError(f"transformers.AutoTokenizer cannot load {str(folder)!r} {why} "
                         f"({type(e).__name__})") from None


def _load_with_transformers(folder: Path, name: str) -> Tokenizer:
    """Fallback for folders without tokenizer.json (e.g. only vocab.json + merges.txt)."""
    expected = "expected tokenizer.json (or files transformers.AutoTokenizer can load)"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f"no tokenizer.json in {str(folder)!r}; {expected}, "
                         "and transformers is not installed") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many types; keep the message one line
        raise UsageError(f"no tokenizer found in {str(folder)!r}; {expected} "
                         f"(AutoTokenizer: {type(e).__name__})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise UsageError(f"{str(folder)!r} holds a slow tokenizer ({type(hf).__name__}); "
                         "timlab needs a fast one (tokenizer.json)")
    special = _special_tokens(folder)
    for key in ("eos", "pad", "bos"):  # what transformers resolved wins over the raw files
        if getattr(hf, f"{key}_token", None) is not None:
            special[key] = getattr(hf, f"{key}_token")
    return _wrap(backend, special, folder, name)


def _wrap(backend: tokenizers.Tokenizer, special: dict[str, Any], folder: Path,
          name: str) -> Tokenizer:
    ids = {key: _to_id(backend, value, key, folder) for key, value in special.items()}
    if ids.get("eos") is None:
        raise UsageError(
            f"no EOS token found in {str(folder)!r}; expected eos_token in tokenizer_config.json "
            "/ special_tokens_map.json or eos_token_id in generation_config.json / config.json")
    return Tokenizer(backend, eos_token_id=ids["eos"], pad_token_id=ids.get("pad"),
                     bos_token_id=ids.get("bos"), name_or_path=name, folder=folder,
                     chat_template=chat_template(folder))


def chat_template(folder: Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: the one named ``default``);
    None when it has none."""
    f = folder / CHAT_TEMPLATE_FILE
    if f.is_file():
        return f.read_text(encoding="utf-8")
    value = _read_json_object(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value else None


def _to_id(backend: tokenizers.Tokenizer, value: Any, key: str, folder: Path) -> int | None:
    """A special token given as a string, an AddedToken dict, an id or a list of ids -> an id."""
    if value is None:
        return None
    if isinstance(value, list):  # generation_config may list several EOS ids; the first is primary
        return _to_id(backend, value[0], key, folder) if value else None
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, int):
        return value
    tid = backend.token_to_id(str(value))
    if tid is None:
        raise UsageError(f"{key} token {value!r} from {str(folder)!r} is not in the vocabulary")
    return tid


def _special_tokens(folder: Path) -> dict[str, Any]:
    """eos/pad/bos as tokens or ids, first found in: tokenizer_config.json, special_tokens_map.json,
    generation_config.json, config.json."""
    sources = [
        ("tokenizer_config.json", "{}_token"),
        ("special_tokens_map.json", "{}_token"),
        ("generation_config.json", "{}_token_id"),
        ("config.json", "{}_token_id"),
    ]
    found: dict[str, Any] = {}
    for filename, pattern in sources:
        data = _read_json_object(folder / filename)
        for key in ("eos", "pad", "bos"):
            value = data.get(pattern.format(key))
            if found.get(key) is None and value is not None:
                found[key] = value
    return found


def _read_json_object(f: Path) -> dict[str, Any]:
    """A JSON object file as a dict ({} when the file does not exist); one-line error otherwise."""
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadFileError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadFileError(f"{f}: expected a JSON object, got a {type(data).__name__}")
    return data
