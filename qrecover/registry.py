"""A registry of plug-in classes by their ``name`` (quantization schemes, model transforms) or another class
attribute (data-source kinds: ``kind``)."""

from __future__ import annotations

from typing import Any

from .errors import QRecoverError


class Registry(dict):
    """``{name: class}`` with registration and one-line errors. ``noun`` names an entry to users ("scheme"),
    ``kind`` the classes in the duplicate-name error ("quantizer"), ``key`` the class attribute holding the
    name (default ``name``)."""

    def __init__(self, noun: str, kind: str, items: dict[str, Any] | None = None, key: str = "name"):
        super().__init__(items or {})
        self.noun, self.kind, self.key = noun, kind, key

    def copy(self) -> Registry:
        return Registry(self.noun, self.kind, dict(self), self.key)

    def register(self, cls: type) -> type:
        """Class decorator: make ``cls`` available by its name (registering the same class again is harmless)."""
        name = getattr(cls, self.key)
        if name in self and self[name] is not cls:
            raise ValueError(f"a {self.kind} named {name!r} is already registered: {self[name]}")
        self[name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self)

    def lookup(self, name: str) -> type:
        """The class registered as ``name``; an unknown name is a one-line error listing the registered ones."""
        if name not in self:
            raise QRecoverError(f"unknown {self.noun} {name!r}; registered {self.noun}s: {self.names()}")
        return self[name]
