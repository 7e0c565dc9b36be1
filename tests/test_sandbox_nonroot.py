"""What a non-root user gets from the sandbox: user namespaces where allowed, else a refusal naming the opt-in.

Run as root, these tests start an evaluator as `nobody` (uid 65534) on a world-readable copy of the sandbox
modules and the system Python: once as it is (user namespaces allowed) and once inside a user namespace
whose limit on user namespaces is 0 (a non-root user without them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import layerprune
from layerprune.cli import main
from layerprune.evaluate import sandbox

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
CLONE_NEWUSER = 0x10000000
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or not shutil.which("setpriv"),
                                reason="needs root (to become nobody), setpriv and a system Python")

PROBE = r'''
import json, os, sys
from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.sandbox import SandboxLimits, available_isolation, run_program
out = {"uid": os.getuid(), "available": list(available_isolation())}
programs = {"good": "assert sum([1, 2]) == 3\n", "early-exit": "import sys\nsys.exit(0)\n",
            "write-etc": "open('/etc/layerprune-nonroot', 'w').write('x')\n",
            "tcp": "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)\n",
            "own-tmp": "open('/tmp/x', 'w').write('x')\nassert open('/tmp/x').read() == 'x'\n"}
for allow in (False, True):
    for name, code in programs.items():
        key = f"{name}{'-unsafe' if allow else ''}"
        try:
            r = run_program(code.replace("PORT", sys.argv[1]), SandboxLimits(timeout_s=5, allow_unsafe=allow))
            out[key] = [r.status, r.isolation]
        except LayerpruneError as exc:
            out[key] = ["refused", str(exc)]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def readable_copy():
    """The sandbox modules (standard library only) in a directory nobody can read."""
    root = Path(tempfile.mkdtemp(prefix="layerprune-nonroot-"))
    package = Path(layerprune.__file__).parent
    for rel in ("__init__.py", "core/__init__.py", "core/errors.py", "evaluate/__init__.py", "evaluate/sandbox.py",
                "evaluate/sandbox_launcher.py"):
        (root / "layerprune" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(package / rel, root / "layerprune" / rel)
    (root / "probe.py").write_text(PROBE)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755)
    yield root
    shutil.rmtree(root)


def _as_nobody(root: Path, port: int, no_user_namespaces: bool) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "HOME": "/nonexistent"}
    argv = [SYSTEM_PYTHON, "-B", str(root / "probe.py"), str(port)]
    if no_user_namespaces:
        argv = [sys.executable, "-c", NO_USERNS, *argv]
    else:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# As root: a child user namespace mapping every id onto itself, whose limit on nested user namespaces is 0;
# then nobody there runs argv. Processes outside are unaffected (the limit belongs to that namespace).
NO_USERNS = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ready, go = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    if libc.unshare(0x10000000) != 0:
        os._exit(3)
    os.write(ready[1], b"x")
    os.read(go[0], 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as handle:
        handle.write("0")
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    os.execve(sys.argv[1], sys.argv[1:], os.environ)
os.read(ready[0], 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{name}", "w") as handle:
        handle.write("0 0 4294967295")
os.write(go[1], b"x")
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def _user_namespaces_for_nobody() -> bool:
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "unshare", "-U", "true"]
    return subprocess.run(argv, capture_output=True).returncode == 0


@pytest.fixture
def listener():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    sock.setblocking(False)
    yield sock
    sock.close()


def test_nobody_with_user_namespaces_gets_them(readable_copy, listener):
    if not _user_namespaces_for_nobody():
        pytest.skip("this kernel gives nobody no user namespaces")
    out = _as_nobody(readable_copy, listener.getsockname()[1], no_user_namespaces=False)
    assert out["uid"] == NOBODY and out["available"][0] == "userns"
    assert out["good"] == ["passed", "userns"] and out["own-tmp"] == ["passed", "userns"]
    assert out["early-exit"][0] == "failed"
    assert out["write-etc"][0] == "blocked" and out["tcp"][0] == "blocked"
    assert not Path("/etc/layerprune-nonroot").exists()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected


def test_nobody_without_user_namespaces_is_refused_unless_unsafe(readable_copy, listener):
    out = _as_nobody(readable_copy, listener.getsockname()[1], no_user_namespaces=True)
    assert out["uid"] == NOBODY and out["available"][0] == "none"
    for name in ("good", "early-exit", "write-etc", "tcp", "own-tmp"):
        assert out[name][0] == "refused"
        assert "--unsafe-code-exec" in out[name][1] and "\n" not in out[name][1]
    assert out["good-unsafe"] == ["passed", "none"] and out["early-exit-unsafe"][0] == "failed"
    assert out["tcp-unsafe"] == ["passed", "none"]  # unsafe means unsafe: only the user's own rights hold
    assert out["write-etc-unsafe"][0] == "blocked" and not Path("/etc/layerprune-nonroot").exists()


def test_evaluate_refuses_humaneval_without_isolation_before_loading(monkeypatch, capsys, shared_data):
    monkeypatch.setattr(sandbox, "available_isolation", lambda: ("none", "not root; userns: unshare: EPERM"))
    monkeypatch.setattr("layerprune.evaluate.runner.handle_for", lambda *a: pytest.fail("model loaded"))
    code = main(["evaluate", "--tasks", "humaneval_plus", "--limit", "1", "--data-dir", str(shared_data),
                 "--output", str(Path(tempfile.gettempdir()) / "layerprune-never-written")])
    err = capsys.readouterr().err
    assert code == 2 and "--unsafe-code-exec" in err and len(err.strip().splitlines()) == 1
