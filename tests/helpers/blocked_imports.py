"""A Python process as it runs where some packages are not installed, without uninstalling them.

`environment_without` writes a `sitecustomize.py` into a directory and puts that directory first on PYTHONPATH:
every Python process started with the returned environment (the real CLI, `python -c`) installs an import hook at
start-up under which the named top-level packages and their submodules are not found, as if not installed:
`importlib.util.find_spec` returns None and an import raises ModuleNotFoundError naming the module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

HOOK = """
import importlib.abc
import sys


class _Hiding(importlib.abc.MetaPathFinder):
    # Wraps a finder so that it finds nothing under BLOCKED: importlib.util.find_spec returns None, and an import
    # raises ModuleNotFoundError, as for a package that is not installed.
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        # importlib.metadata: a package that is not installed has no distribution either.
        find = getattr(self.finder, "find_distributions", None)
        for distribution in find(*args, **kwargs) if find else ():
            if (distribution.metadata["Name"] or "").lower() not in BLOCKED:
                yield distribution

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
"""


def environment_without(packages: Sequence[str], directory: Path) -> dict[str, str]:
    """This process's environment, plus the hook that makes `packages` (top-level names) impossible to import."""
    if not packages:
        raise ValueError("environment_without: name at least one package to block")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(f"BLOCKED = {set(packages)!r}\n{HOOK}")
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), environment.get("PYTHONPATH")]))
    return environment
