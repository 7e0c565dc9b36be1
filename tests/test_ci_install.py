"""The Makefile's installs go through uv with the options pip would install with handed on (.ci/uv_install.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("uv_install", ROOT / ".ci" / "uv_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uv_gets_the_options_pip_itself_resolves_install_over_global_and_the_environment_over_files(tmp_path,
                                                                                                  monkeypatch):
    uv = _module()
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://global.example/simple\nextra-index-url = file:///x/simple "
                      "file:///y/simple\nfind-links = /from-file\n\n[install]\nindex-url = https://install.example/simple"
                      "\n\n[download]\nindex-url = https://download.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))  # read last: its keys win over the machine's files
    monkeypatch.setenv("PIP_FIND_LINKS", "/from-env /more")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    env = uv.uv_environment(uv.pip_options(sys.executable))
    assert env["UV_INDEX_URL"] == "https://install.example/simple"
    assert env["UV_EXTRA_INDEX_URL"] == "file:///x/simple file:///y/simple"
    assert env["UV_FIND_LINKS"] == "/from-env,/more" and env["UV_INDEX_STRATEGY"] == "unsafe-best-match"


def test_no_index_and_constraints_carry_and_unset_options_stay_unset():
    uv = _module()
    env = uv.uv_environment({"index_url": None, "extra_index_urls": [], "find_links": ["/w"], "constraints": ["/c1",
                             "/c2"], "no_index": True, "cert": None})
    assert env == {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_FIND_LINKS": "/w",
                   "UV_CONSTRAINT": "/c1 /c2", "UV_NO_INDEX": "true"}
