"""Reading YAML a user wrote (configs, sweep specs, ``--set`` values): safe, strict and bounded.

``load_yaml`` is ``yaml.safe_load`` plus three refusals, each a one-line ``BadFileError``:
a mapping with the same key twice (PyYAML silently keeps the last value), a recursive alias
(``&a [*a]``), and a document whose aliases expand to more than ``MAX_NODES`` nodes (a
"billion laughs" spec of a few hundred bytes expands to gigabytes once anything walks it).
The size is counted on the composed node graph, where each alias is a shared reference, so
the check itself costs one visit per distinct node.
"""

from __future__ import annotations

import yaml

from timlab.errors import BadFileError

MAX_NODES = 100_000
"""Most nodes a document may hold with its aliases expanded (a 10-condition x 1000-value grid is ~10^4)."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a duplicate key in a mapping (merge keys ``<<`` aside)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r} (the first value would be silently dropped)",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node, where: str, error: type[Exception]) -> int:
    """Nodes in ``root`` with every alias expanded; a cycle or more than MAX_NODES is an error."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise error(f"{where}: a recursive YAML alias (a node that contains itself)")
        active.add(key)
        children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else ()
        total = 1
        for child in children:
            for sub in (child if isinstance(child, tuple) else (child,)):
                total += size(sub)
                if total > MAX_NODES:
                    raise error(f"{where}: the YAML expands to more than {MAX_NODES} nodes "
                                       "(aliases nested inside aliases); write the values out")
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str, where: str, error: type[Exception] = BadFileError):
    """``text`` parsed as YAML (``None`` for an empty document); ``where`` names it in the
    one-line ``error`` raised for anything refused."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, where, error)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise error(f"{where}: invalid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise error(f"{where}: YAML nested too deeply") from None
    finally:
        loader.dispose()


__all__ = ["load_yaml", "MAX_NODES"]
