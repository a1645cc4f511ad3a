"""Optional dependencies: none is imported by importing Tandem's modules, a missing one is named with the extra that
installs it, and the extras named in code are the ones pyproject.toml declares (dev installs them all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import StartupError
from tandem.extras import BENCH, RAY, Extra

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tandem", "orchestrator", "target_server", "draft_server", "launch", "training", "bench")
OPTIONAL = ("ray", "matplotlib")

# The modules that run only under Ray, and import it at the top.
RAY_MODULES = ("launch.ray_cluster", "launch.ray_actors", "launch.ray_reservation")
# Imports every module of the packages but the Ray launcher's, and reports which optional modules came along.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
imported = []
for package in sys.argv[1].split(","):
    root = importlib.import_module(package)
    for module in pkgutil.walk_packages(root.__path__, package + "."):
        if module.name not in sys.argv[3].split(","):
            importlib.import_module(module.name)
            imported.append(module.name)
optional = [name for name in sys.argv[2].split(",") if name in sys.modules]
print(json.dumps({"imported": imported, "optional": optional}))
"""


def test_importing_every_module_but_the_ray_launcher_imports_no_optional_dependency() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(PACKAGES), ",".join(OPTIONAL), ",".join(RAY_MODULES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    report = json.loads(finished.stdout.splitlines()[-1])
    wanted = {"launch.cli", "launch.processes", "orchestrator.main", "target_server.main", "draft_server.main"}
    assert wanted | {"bench.report", "bench.plot"} <= set(report["imported"])
    assert report["optional"] == []


def test_the_product_command_imports_no_bench_module_and_no_psutil() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import json, sys, launch.cli; print(json.dumps(sorted(sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    modules = json.loads(finished.stdout.splitlines()[-1])
    assert "launch.cli" in modules
    assert [name for name in modules if name == "bench" or name.startswith(("bench.", "psutil"))] == []


def test_the_benchmarks_without_psutil_stop_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench.cli
    from launch.cli import main

    monkeypatch.setattr(bench.cli, "PSUTIL", Extra(BENCH.name, "tandem_test_no_such_module"))
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # what `bench` sets in this process; restored afterwards
    for command in ("bench", "bench-load"):
        assert main([command, "--target", "t", "--draft", "d"]) == 2
        error = capsys.readouterr().err
        assert f"tandem {command} cannot start: the tandem_test_no_such_module package is not installed" in error
        assert "(pip install 'tandem[bench]')" in error


def test_psutil_is_in_the_bench_extra_not_in_the_runtime_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11 on")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(requirement.startswith("psutil") for requirement in project["dependencies"])
    assert any(requirement.startswith("psutil") for requirement in project["optional-dependencies"]["bench"])


def test_a_missing_extra_is_named_with_its_install_command() -> None:
    extra = Extra("bench", "tandem_test_no_such_module")
    assert extra.missing() == ("the tandem_test_no_such_module package is not installed (pip install 'tandem[bench]')")
    with pytest.raises(StartupError) as refused:
        extra.require("--some-flag")
    assert str(refused.value) == f"--some-flag: {extra.missing()}"


def test_an_installed_extra_is_not_missing() -> None:
    assert BENCH.missing() is None  # the dev extra installs matplotlib
    RAY.require("--launcher ray")


def test_an_installed_module_whose_own_import_fails_raises_instead_of_passing_for_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tandem_test_broken").mkdir()
    (tmp_path / "tandem_test_broken" / "__init__.py").write_text("import tandem_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as failed:
        Extra("bench", "tandem_test_broken").missing()
    assert failed.value.name == "tandem_test_absent_dependency"


def test_the_extras_are_declared_in_pyproject_and_dev_installs_them() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11 on")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in (RAY, BENCH):
        assert any(requirement.startswith(extra.module) for requirement in extras[extra.name]), extra
    assert f"tandem[{RAY.name},{BENCH.name}]" in extras["dev"]
