"""`python .ci/uv_install.py VENV [uv pip install arguments]`: install into VENV with uv, as pip would there.

The Makefile's installs go through uv (about 7x faster than pip here: the venv's packages in ~10 s instead of ~70 s).
uv reads its own settings, not pip's, so the indexes, find-links and constraints that pip is configured with on this
machine (its config files and PIP_* variables, as `pip config list` shows them) are handed to uv, and uv resolves
across all indexes the way pip does (unsafe-best-match: the best version wherever it is), so both install the same
versions. `--uninstall` runs `uv pip uninstall` instead. uv itself comes from pip, into VENV.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

# pip's option -> (uv's variable, the separator uv reads in it)
OPTIONS = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
           "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "),
           "no-index": ("UV_NO_INDEX", " "), "cert": ("SSL_CERT_FILE", " ")}


def pip_settings(pip: Path) -> dict[str, str]:
    """pip's configured options (`pip config list`: files first, then its PIP_* variables, which win)."""
    listed = subprocess.run([str(pip), "config", "list"], capture_output=True, text=True, check=True).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        key, _, raw = line.partition("=")
        scope, _, option = key.rpartition(".")
        if option not in OPTIONS or not raw:
            continue
        rank = 1 if scope == ":env:" else 0
        if option not in found or rank >= found[option][0]:
            found[option] = (rank, str(ast.literal_eval(raw)))
    return {option: value for option, (_, value) in found.items()}


def uv_environment(settings: dict[str, str]) -> dict[str, str]:
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for option, value in settings.items():
        name, separator = OPTIONS[option]
        if option == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                env[name] = "true"
        else:
            env[name] = separator.join(value.split())
    return env


def main(argv: list[str]) -> int:
    venv, args = Path(argv[0]), argv[1:]
    pip, uv = venv / "bin" / "pip", venv / "bin" / "uv"
    if not uv.is_file():
        subprocess.run([str(pip), "install", "-q", "uv"], check=True)
    env = {**os.environ, **uv_environment(pip_settings(pip))}
    verb = ["uninstall"] if args[:1] == ["--uninstall"] else ["install", "-q"]
    rest = args[1:] if verb == ["uninstall"] else args
    command = [str(uv), "pip", *verb, "--python", str(venv / "bin" / "python"), *rest]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
