"""`python .ci/uv_install.py VENV [uv pip install arguments]`: install into VENV with uv, as pip would there.

The Makefile's installs go through uv (about 6x faster than pip here: the venv's packages in ~12 s instead of ~70 s).
uv reads its own settings, not pip's, so the options pip would install with on this machine (its config files and
PIP_* variables, resolved by pip itself: `[install]` over `[global]`, later files over earlier ones, the environment
over both) are handed to uv, and uv resolves across all indexes the way pip does (unsafe-best-match: the best version
wherever it is), so both install the same versions. `--uninstall` runs `uv pip uninstall` instead. uv itself comes
from pip, into VENV, at the version pinned here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.9"
# pip's own reading of its configuration for `pip install` (pip >= 20: create_command and its option names)
PIP_OPTIONS = """
import json
from pip._internal.commands import create_command
options, _ = create_command("install").parse_args([])
print(json.dumps({name: getattr(options, name, None) for name in
                  ("index_url", "extra_index_urls", "find_links", "constraints", "no_index", "cert")}))
"""


def pip_options(python: Path | str) -> dict[str, object]:
    """The index, find-links, constraints, no-index and cert options `pip install` would use under `python`."""
    done = subprocess.run([str(python), "-c", PIP_OPTIONS], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def uv_environment(options: dict[str, object]) -> dict[str, str]:
    """uv's variables for pip's options."""
    # no bytecode compiled up front (pip's default, uv's option): the Makefile lets Python write each module's
    # bytecode when it is first imported, a fraction of the packages (torch's and transformers' whole trees: ~30 s)
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    if options.get("index_url"):
        env["UV_INDEX_URL"] = str(options["index_url"])
    for key, name, separator in (("extra_index_urls", "UV_EXTRA_INDEX_URL", " "), ("find_links", "UV_FIND_LINKS", ","),
                                 ("constraints", "UV_CONSTRAINT", " ")):
        if values := [str(v) for v in options.get(key) or []]:  # type: ignore[union-attr]
            env[name] = separator.join(values)
    if options.get("no_index"):
        env["UV_NO_INDEX"] = "true"
    if options.get("cert"):
        env["SSL_CERT_FILE"] = str(options["cert"])
    return env


def main(argv: list[str]) -> int:
    venv, args = Path(argv[0]), argv[1:]
    python, uv = venv / "bin" / "python", venv / "bin" / "uv"
    if not uv.is_file():
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", UV], check=True)
    env = {**os.environ, **uv_environment(pip_options(python))}
    verb = ["uninstall"] if args[:1] == ["--uninstall"] else ["install", "-q"]
    rest = args[1:] if verb == ["uninstall"] else args
    return subprocess.run([str(uv), "pip", *verb, "--python", str(python), *rest], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
