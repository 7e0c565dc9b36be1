"""layerprune's own version, from below: the base floor asks the installed distribution, not the package face.

`package_version()` is the one source: the package face's `__version__`, provenance records and the evaluation
cache's keys all take it from here. Order: the installed distribution's metadata (`importlib.metadata`); when
layerprune is not installed (a source tree on the path), the `[project]` version of the checkout's pyproject.toml;
else "unknown".
"""

from __future__ import annotations

import importlib.metadata
import re
from functools import lru_cache
from pathlib import Path

DISTRIBUTION = "layerprune"
UNKNOWN = "unknown"
PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"  # src/layerprune/core/version.py -> the checkout


@lru_cache(maxsize=1)
def package_version() -> str:
    """The version of the layerprune that runs: distribution metadata, else the source tree's pyproject, else
    'unknown'."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return pyproject_version(PYPROJECT) or UNKNOWN


def pyproject_version(path: Path) -> str | None:
    """The `[project]` version of a pyproject.toml that names layerprune; None when absent or another project's."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    table = re.search(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    if table is None or not re.search(rf'^name\s*=\s*"{DISTRIBUTION}"', table.group(1), re.MULTILINE):
        return None
    version = re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.MULTILINE)
    return version.group(1) if version else None
