"""What a user can name, read from the source without importing torch: the registered names of
each plug-in kind, a library function's keyword defaults, and every config key with its type,
default and help.

The CLI's help and ``timlab config`` print from here, so ``--help`` stays fast (no torch import)
while each name, default and help text keeps its one home: the ``@REGISTRY.register("name")``
decorator, the function's signature, the config dataclass field and the docstring under it.
``tests/test_cli_help.py`` checks that the names read here equal the live registries'.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

KINDS: dict[str, tuple[str, str]] = {
    # kind: (package folder, the decorator that registers a name there)
    "task": ("tasks", "TASKS.register"),
    "engine": ("engines", "ENGINES.register"),
    "injector": ("injectors", "register"),
    "scheduler": ("schedulers", "SCHEDULERS.register"),
    "advantage": ("trainer", "ADVANTAGES.register"),
    "is_level": ("remedies", "IS_LEVELS.register"),
    "is_mode": ("remedies", "IS_MODES.register"),
}
"""Each kind of registered piece: where its modules live and how they register a name."""

EXTRA_NAMES: dict[str, tuple[str, ...]] = {"injector": ("none",)}
"""Names a config accepts besides the registered ones (``mismatch.injector: none``)."""

CONFIG_NAME_KEYS: dict[str, str] = {
    "task.name": "task", "rollout.engine": "engine", "mismatch.injector": "injector",
    "scheduler.name": "scheduler", "algorithm.name": "advantage",
    "correction.level": "is_level", "correction.mode": "is_mode",
}
"""Config keys that pick a registered piece: ``timlab config`` lists their valid names."""


def _decorator_name(node: ast.expr) -> str | None:
    """``TASKS.register`` for ``@TASKS.register("x")``, ``register`` for ``@register("x")``."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


@functools.cache
def names(kind: str) -> tuple[str, ...]:
    """The names registered for ``kind`` (one of ``KINDS``), sorted, plus its ``EXTRA_NAMES``."""
    if kind not in KINDS:
        raise KeyError(f"unknown kind {kind!r}; valid choices: {', '.join(KINDS)}")
    folder, decorator = KINDS[kind]
    found = set(EXTRA_NAMES.get(kind, ()))
    for path in sorted((PACKAGE / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for deco in getattr(node, "decorator_list", ()):
                if _decorator_name(deco) == decorator and deco.args and isinstance(deco.args[0], ast.Constant):
                    found.add(deco.args[0].value)
    return tuple(sorted(found))


def _module_path(module: str) -> Path:
    """``timlab.experiments.diagnostics.probe`` -> the file that holds it, found without importing it."""
    parts = module.split(".")
    if parts[0] != PACKAGE.name:
        raise ValueError(f"{module}: not a timlab module")
    return PACKAGE.joinpath(*parts[1:]).with_suffix(".py")


@functools.cache
def function_defaults(target: str) -> dict[str, str]:
    """``"timlab.experiments.diagnostics.probe:run_probe"`` -> {keyword: its default, as the user reads it}: a
    literal as written, and a module-level constant (``batch_sizes=DEFAULT_BATCH_SIZES``) by the
    literal value assigned to it in the same module, not by its name."""
    module, name = target.split(":")
    body = ast.parse(_module_path(module).read_text(encoding="utf-8")).body
    constants = {t.id: node.value for node in body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            return {arg.arg: _literal(d, constants) for arg, d in pairs}
    raise ValueError(f"{target}: no such function")


def _literal(node: ast.expr, constants: dict[str, ast.expr]) -> str:
    if isinstance(node, ast.Name) and constants.get(node.id) is not None:
        node = constants[node.id]
    try:
        return str(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key ``--set section.key=value`` accepts."""

    key: str
    type: str
    default: object
    help: str


@functools.cache
def _field_docs() -> dict[str, str]:
    """{"Section.field": the docstring under the field, as plain text} from config.py's source."""
    docs = {}
    for cls in ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8")).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        body = cls.body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[f"{cls.name}.{stmt.target.id}"] = " ".join(nxt.value.value.split()).replace("`", "")
    return docs


def config_keys() -> list[ConfigKey]:
    """Every config key in section order, with its type, default and help (its field docstring,
    plus the valid names where the key picks a registered piece)."""
    from timlab.config import SECTIONS

    docs = _field_docs()
    out = []
    for section, cls in SECTIONS.items():
        default = cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            text = docs.get(f"{cls.__name__}.{f.name}", "")
            if key in CONFIG_NAME_KEYS:
                text = (text + " " if text else "") + f"Valid: {', '.join(names(CONFIG_NAME_KEYS[key]))}."
            out.append(ConfigKey(key, str(f.type), getattr(default, f.name), text))
    return out
