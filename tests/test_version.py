"""layerprune's version comes from below (layerprune.core.version): the package face, provenance, the cache and
`layerprune --version` all say the same, installed or run from a source tree."""

from __future__ import annotations

import importlib.metadata

import pytest

import layerprune
from layerprune.cli import main
from layerprune.core import version
from layerprune.core.provenance import collect_provenance
from layerprune.core.version import package_version, pyproject_version
from layerprune.evaluate import cache

SOURCE_PYPROJECT = version.PYPROJECT  # this checkout's own, found from the module's place


@pytest.fixture
def fresh_version():
    package_version.cache_clear()
    yield
    package_version.cache_clear()


def not_installed(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def test_every_reader_says_the_installed_distributions_version(capsys):
    installed = importlib.metadata.version("layerprune")
    assert package_version() == layerprune.__version__ == cache.__version__ == installed
    assert collect_provenance().layerprune == installed and "__version__" in dir(layerprune)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"layerprune {installed}"


def test_a_source_tree_that_is_not_installed_reads_its_pyproject(fresh_version, monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[build-system]\nrequires = ["x"]\n\n[project]\nname = "layerprune"\nversion = "7.1.0.dev2"\n'
                         '\n[tool.other]\nversion = "9"\n')
    monkeypatch.setattr(version, "PYPROJECT", pyproject)
    assert package_version() == "7.1.0.dev2" and pyproject_version(SOURCE_PYPROJECT) is not None


@pytest.mark.parametrize("text", [None, '[project]\nname = "other"\nversion = "1.0"\n',
                                  '[project]\nname = "layerprune"\n\n[tool.x]\nversion = "1.0"\n'])
def test_neither_installed_nor_in_its_own_checkout_is_unknown(fresh_version, monkeypatch, tmp_path, text):
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = tmp_path / "pyproject.toml"
    if text is not None:
        pyproject.write_text(text)
    monkeypatch.setattr(version, "PYPROJECT", pyproject)
    assert pyproject_version(pyproject) is None and package_version() == "unknown"
