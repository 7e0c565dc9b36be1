"""`make test` runs the real-vLLM lane beside lint and the tests; a lint failure stops that lane and ends at once."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# stands in for $(MAKE): `vllm-install` is the lane (it writes its pid, then sleeps); `lint` waits until the lane has
# started, then fails as ruff would
FAKE_MAKE = """#!/bin/sh
case "$2" in
  vllm-install) echo $$ > "$LANE_PID"; exec sleep 30 ;;
  lint) i=0; while [ ! -s "$LANE_PID" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done;
        echo "E501 line too long"; exit 1 ;;
esac
exit 2
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_lint_failure_stops_the_vllm_lane(tmp_path):
    fake = tmp_path / "make"
    fake.write_text(FAKE_MAKE)
    fake.chmod(0o755)
    pid_file = tmp_path / "lane.pid"
    env = {**os.environ, "LANE_PID": str(pid_file)}
    env.pop("MAKEFLAGS", None)
    proc = subprocess.Popen(
        ["make", "-s", "-C", str(REPO), "test", f"MAKE={fake}", f"VLLM_VENV={tmp_path / 'venv-vllm'}",
         f"BIN={tmp_path / 'bin'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lane = None
    try:
        # the lane sleeps 30 s: a `make test` that waits for it instead of stopping it runs past this bound
        out, _ = proc.communicate(timeout=20)
        lane = int(pid_file.read_text())
        assert proc.returncode != 0, out
        assert "lint failed: the real-vLLM lane was stopped" in out, out
        deadline = time.monotonic() + 5
        while _alive(lane) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(lane), "the vLLM lane outlived make test"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if lane is None and pid_file.exists() and pid_file.read_text().strip():
            lane = int(pid_file.read_text())
        if lane is not None and _alive(lane):
            os.kill(lane, signal.SIGKILL)
