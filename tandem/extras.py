"""Optional dependencies, installed as extras of the package: `pip install 'tandem[NAME]'`.

Running Tandem needs none of them. Each is imported only on the path that uses it (no module imports one at module
level), and a path that needs a missing one says which extra to install: a StartupError before anything starts
(`tandem serve --launcher ray`), or a line in the output where the work goes on without it (`tandem bench`'s plot).
The extras themselves are declared in pyproject.toml; `dev` includes them all so that the tests cover every path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tandem.errors import StartupError


@dataclass(frozen=True)
class Extra:
    name: str  # pip install 'tandem[name]'
    module: str  # the top-level module it provides

    def install_command(self) -> str:
        return f"pip install 'tandem[{self.name}]'"

    def missing(self) -> str | None:
        """None when the module imports (it is imported: call this on the path that uses it), else one line saying
        it is not installed and how to install it. An installed module that fails to import raises as it is."""
        try:
            importlib.import_module(self.module)
        except ModuleNotFoundError as error:
            if error.name is None or error.name.partition(".")[0] != self.module:
                raise  # the module is there; something it imports is not
            return f"the {self.module} package is not installed ({self.install_command()})"
        return None

    def require(self, needed_by: str) -> None:
        """Raises StartupError naming `needed_by` (a flag) and the extra when the module is not installed."""
        reason = self.missing()
        if reason is not None:
            raise StartupError(f"{needed_by}: {reason}")


RAY = Extra("ray", "ray")  # tandem serve --launcher ray (launch/ray_cluster.py)
BENCH = Extra("bench", "matplotlib")  # the acceptance plot of tandem bench (bench/plot.py)
