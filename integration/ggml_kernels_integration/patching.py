"""Every change `enable()` makes to other libraries, recorded so it can be undone.

A `PatchSet` sets attributes, dictionary entries and environment variables and remembers what was
there before (or that nothing was). `restore()` puts everything back in reverse order, so a failure
halfway through `enable()` leaves the process as it was, and `disable()` undoes a whole `enable()`.
Wrappers installed through a patch set capture the attribute they replace at install time, so a
second `enable()` after `disable()` wraps the originals again, never its own wrappers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any

_MISSING = object()


class PatchSet:
    """An undo log of attribute, item and environment changes."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.changed: list[str] = []  # "module.attr" descriptions, in the order they were made
        self._replaced: dict[tuple[int, str], Any] = {}  # (id(owner), name) -> first value replaced

    def __len__(self) -> int:
        return len(self._undo)

    def set_attr(self, owner: Any, name: str, value: Any) -> Any:
        """`owner.name = value`; returns the value it replaces (as `getattr` reads it: inherited too; None
        where `owner` had no `name`)."""
        previous = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
        replaced = getattr(owner, name, None)

        def undo() -> None:
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

        setattr(owner, name, value)
        self._record(undo, f"{_qualname(owner)}.{name}")
        self._replaced.setdefault((id(owner), name), replaced)
        return replaced

    def original(self, owner: Any, name: str) -> Any:
        """What `owner.name` was before this set first changed it (KeyError if it never did)."""
        return self._replaced[(id(owner), name)]

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Replace `owner.name` by `make(original)`; returns the original."""
        original = getattr(owner, name)
        self.set_attr(owner, name, make(original))
        return original

    def set_item(self, mapping: MutableMapping, key: Any, value: Any, label: str = "") -> None:
        previous = mapping.get(key, _MISSING)

        def undo() -> None:
            if previous is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = previous

        mapping[key] = value
        self._record(undo, f"{label or type(mapping).__name__}[{key!r}]")

    def set_env(self, name: str, value: str) -> None:
        self.set_item(os.environ, name, value, label="os.environ")

    def on_restore(self, undo: Callable[[], None], description: str = "") -> None:
        """Run `undo()` when the set is restored (after the changes recorded later are undone)."""
        self._record(undo, description or getattr(undo, "__qualname__", repr(undo)))

    def restore(self) -> None:
        """Undo every change, newest first. Every undo runs even if one fails; the first error is raised."""
        error = None
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # noqa: BLE001 - keep undoing, report the first failure
                error = error or e
        self.changed.clear()
        self._replaced.clear()
        if error is not None:
            raise error

    def _record(self, undo: Callable[[], None], description: str) -> None:
        self._undo.append(undo)
        self.changed.append(description)


def _qualname(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", type(owner).__name__)
