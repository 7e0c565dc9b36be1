"""The Makefile's installs go through uv with pip's configuration handed on (.ci/uv_install.py)."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("uv_install", ROOT / ".ci" / "uv_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_pip(tmp_path: Path, listed: str) -> Path:
    pip = tmp_path / "pip"
    pip.write_text(f"#!/bin/sh\ncat <<'END'\n{listed}\nEND\n")
    pip.chmod(pip.stat().st_mode | stat.S_IEXEC)
    return pip


def test_pips_indexes_links_and_constraints_reach_uv_and_its_environment_wins(tmp_path):
    uv = _module()
    pip = _fake_pip(tmp_path, "\n".join([
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///a/simple file:///b/simple'",
        "global.find-links='/elsewhere /more'",
        "global.timeout='60'",
        "user.no-index='false'",
    ]))
    env = uv.uv_environment(uv.pip_settings(pip))
    assert env == {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_FIND_LINKS": "/opt/wheels",
                   "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
                   "UV_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple"}


def test_several_find_links_are_comma_separated_for_uv_and_no_index_carries(tmp_path):
    uv = _module()
    pip = _fake_pip(tmp_path, "global.find-links='/one /two'\nsite.no-index='1'\nglobal.index-url='https://x/simple'")
    env = uv.uv_environment(uv.pip_settings(pip))
    assert env["UV_FIND_LINKS"] == "/one,/two" and env["UV_NO_INDEX"] == "true"
    assert env["UV_INDEX_URL"] == "https://x/simple"
