"""Name -> object registries for every pluggable piece (engines, tasks, injectors, IS modes,
schedulers, advantage estimators).

Registering a name twice raises; looking up an unknown name raises a one-line error that lists
the valid names. This module imports nothing else from timlab so the pure layer can use it.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from timlab.errors import TimlabError, UsageError

T = TypeVar("T")


class UnknownNameError(TimlabError, KeyError):
    """Raised for a name that is not in a registry; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it a readable line
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of objects, e.g. ``ENGINES = Registry("engine")``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("token_tis")``. Duplicate names raise ValueError."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise UsageError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid choices: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)
