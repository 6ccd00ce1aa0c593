"""Name -> parser class registries with lazy imports, plus loading of user plugin files."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


class ParserRegistry:
    """Built-in parsers are listed as (module, class) and imported on first use; plugins register classes directly."""

    def __init__(self, kind: str, builtins: dict[str, tuple[str, str]]) -> None:
        self.kind = kind
        self._lazy = dict(builtins)
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        """Decorator for plugin files: `@tool_parsers.register("my_parser")`."""
        def deco(cls: type) -> type:
            self._classes[name] = cls
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(set(self._lazy) | set(self._classes))

    def get(self, name: str) -> type:
        if name in self._classes:
            return self._classes[name]
        if name not in self._lazy:
            raise ValueError(f"Unknown {self.kind} parser {name!r}; available: {', '.join(self.names())}.")
        module, cls = self._lazy[name]
        self._classes[name] = getattr(importlib.import_module(module), cls)
        return self._classes[name]

    def load_plugin(self, path: str) -> None:
        """Import a user's Python file; it registers its parsers through `register`."""
        if not os.path.isfile(path):
            raise ValueError(f"{self.kind} parser plugin {path!r} does not exist.")
        name = f"tokenmill_plugin_{abs(hash(os.path.abspath(path)))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"Could not load {self.kind} parser plugin {path!r}: {e}") from e
