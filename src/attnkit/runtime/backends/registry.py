"""The registry of backends by name, as vLLM's attention registry: entries are "module:Class" paths imported on
first use, so a backend module (and whatever it imports at its top) loads only when a call asks about it;
`register()` adds a backend from outside attnkit, by path or as an instance."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

from attnkit.runtime.backends.base import Backend


class Registry(MutableMapping[str, Backend]):
    """name -> Backend, in registration order (the order explain() falls back to after the priority order)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths: dict[str, str | Backend] = dict(paths)
        self._made: dict[str, Backend] = {}

    def register(self, backend: str | Backend, name: str | None = None) -> None:
        """Add (or replace) a backend: a "package.module:Class" path, imported when first used, or an instance."""
        if isinstance(backend, Backend):
            name = name or backend.name
        elif not isinstance(backend, str) or ":" not in backend or not name:
            raise ValueError("register(): give a Backend instance, or a 'package.module:Class' path and its name")
        if not name:
            raise ValueError("register(): the backend has no name")
        self._paths[name] = backend
        self._made.pop(name, None)

    def __getitem__(self, name: str) -> Backend:
        made = self._made.get(name)
        if made is not None:
            return made
        entry = self._paths[name]  # KeyError: unknown backend
        if isinstance(entry, Backend):
            made = entry
        else:
            module, _, cls = entry.partition(":")
            made = getattr(importlib.import_module(module), cls)()
            if made.name != name:
                raise ValueError(f"backend registry: {entry} is named {made.name!r}, registered as {name!r}")
        self._made[name] = made
        return made

    def __setitem__(self, name: str, backend: Backend) -> None:
        self.register(backend, name)

    def __delitem__(self, name: str) -> None:
        del self._paths[name]
        self._made.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths
