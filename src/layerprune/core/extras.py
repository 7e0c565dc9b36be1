"""Optional dependencies, installed by the package's extras; a missing one is a one-line error naming its extra."""

from __future__ import annotations

import importlib.util

from layerprune.core.errors import LayerpruneError

# extra -> {distribution: the module it installs}; pyproject.toml's [project.optional-dependencies] lists the same
EXTRAS: dict[str, dict[str, str]] = {
    "analyze": {"scikit-learn": "sklearn", "scipy": "scipy"},
    "gguf-run": {"llama-cpp-python": "llama_cpp"},
    "qlora": {"bitsandbytes": "bitsandbytes"},
}


def require_extra(extra: str, what: str) -> None:
    """Fail with one line when a package of `extra` is not installed (found without importing it)."""
    absent = [dist for dist, module in EXTRAS[extra].items() if not _installed(module)]
    if absent:
        raise LayerpruneError(f"{what} needs {', '.join(absent)}, which is not installed: "
                              f"pip install 'layerprune[{extra}]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec
        return True
