"""HumanEval+ scored as EvalPlus scores it.

- Expected outputs come from the dataset's canonical solutions, run in one trusted subprocess for the whole
  dataset (outside any candidate's budget; 164 interpreter starts were a quarter of the oracle's CPU time) and
  cached by the dataset's content hash, with the time each input took. Each problem gets REFERENCE_TIMEOUT, kept
  by a watchdog thread in that process (faulthandler's, so a reference stuck inside C code is stopped too); the
  parent kills a run that announces no new problem within REFERENCE_TIMEOUT + REFERENCE_MARGIN.
- Each input of a candidate gets max(MIN_TIME_LIMIT, GT_TIME_LIMIT_FACTOR x the reference's time); the whole
  program gets the sum of those, capped (EvalPlus's EVALPLUS_TIMEOUT_PER_TASK, our `sandbox_timeout`).
- Outputs are compared as EvalPlus's `untrusted_check` does: exact, else (floats or atol) `np.allclose` with
  rtol 1e-7 (here in plain Python: the sandbox need not import numpy), and |poly(x)| <= atol for find_zero.
- A pass means every check ran: the program ends by writing a line with a per-run nonce and the count of inputs
  checked, and the harness requires it (an early `sys.exit(0)` / `os._exit(0)` exits 0 without it).
- Each run's sandbox status is kept: passed, failed, timeout, memory, blocked, killed or error.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pickle
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.sandbox import SandboxLimits, run_program

# EvalPlus's defaults (evalplus/config.py; untrusted_check)
GT_TIME_LIMIT_FACTOR = 4.0
MIN_TIME_LIMIT = 1.0
TASK_TIMEOUT_CAP = 60.0
STARTUP_SLACK = 2.0  # interpreter start and loading the inputs, on top of the inputs' limits
REFERENCE_TIMEOUT = 600.0  # per problem, kept by the oracle run's own watchdog
REFERENCE_MARGIN = 30.0  # then the parent kills an oracle run that announced no new problem (its watchdog failed)
REFERENCE_STARTUP = 60.0  # the parent's allowance for the oracle run to start and announce its first problem
ORACLE_VERSION = "4"  # part of the cache key: bump when the way expected outputs are computed changes
STATUSES = ("passed", "failed", "timeout", "memory", "blocked", "killed", "error")
INLINE_BYTES = 64 << 10  # an expected output larger than this (pickled) is carried as a digest, not its value
REFERENCE_MARK = "layerprune-reference-start "  # the oracle run writes it and a task id to stderr before each problem
WATCHDOG_HEADER = re.compile(r"Timeout \(\d+:\d\d:\d\d(\.\d+)?\)!")  # faulthandler's first line when it fires
WATCHDOG_FRAME = re.compile(r'File "reference\.py", line (\d+) in (\S+)')


@functools.cache
def programs_source() -> str:
    """The text of humaneval_programs.py: both subprocess programs are it plus a tail that calls one entry point."""
    return resources.files("layerprune.evaluate").joinpath("humaneval_programs.py").read_text(encoding="utf-8")


def reference_program() -> str:
    """The trusted oracle run: reads the job (every problem's code, entry point and inputs) as JSON on stdin, writes
    a pickle of (done, failure)."""
    return programs_source() + "\n_references()\n"


@dataclass(frozen=True)
class Oracle:
    """A problem's expected outputs (base inputs, then plus inputs) and the seconds the reference took on each."""

    outputs: list[Any]  # None where the output is carried by its digest
    seconds: list[float]
    digests: list[str | None]


@dataclass(frozen=True)
class Verdict:
    """How one candidate ended: a sandbox status, what the harness saw, and the wall time."""

    status: str
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def problem_inputs(row: dict[str, Any]) -> list[Any]:
    """Base inputs then plus inputs (flattened rows carry them as a JSON string)."""
    if "inputs" in row:
        return list(json.loads(row["inputs"]))
    return list(row.get("base_input") or []) + list(row.get("plus_input") or [])


def reference_code(row: dict[str, Any]) -> str:
    return row["prompt"] + row.get("reference", row.get("canonical_solution", ""))


def dataset_hash(rows: Sequence[dict[str, Any]]) -> str:
    """Content hash of what the expected outputs depend on."""
    digest = hashlib.sha256(f"oracle:{ORACLE_VERSION}\n".encode())
    for row in rows:
        part = {"task_id": row["task_id"], "code": reference_code(row), "entry_point": row["entry_point"],
                "inputs": problem_inputs(row)}
        digest.update(json.dumps(part, sort_keys=True).encode())
    return digest.hexdigest()


def _reference_env() -> dict[str, str]:
    # same hash seed as the sandbox, so set-ordered outputs agree
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _run_oracle(job: bytes) -> tuple[int | None, bytes, bytes]:
    """Run the oracle program on the job: (exit status, or None where it stalled and was killed; stdout; stderr).
    Its own watchdog ends a problem that runs over; this one kills it when no problem was announced within
    REFERENCE_TIMEOUT + REFERENCE_MARGIN of the last (REFERENCE_STARTUP before the first)."""
    command = [sys.executable, "-I", "-B", "-c", reference_program()]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=_reference_env()) as proc:
        out: list[bytes] = []
        err: list[bytes] = []
        marks: list[float] = []

        def feed() -> None:
            try:
                proc.stdin.write(job)  # type: ignore[union-attr]
                proc.stdin.close()
            except OSError:  # it died before reading the whole job: its stderr says why
                pass

        def read_stdout() -> None:
            out.append(proc.stdout.read() if proc.stdout else b"")

        def read_stderr() -> None:
            for line in proc.stderr or ():
                if line.startswith(REFERENCE_MARK.encode()):
                    marks.append(time.monotonic())
                err.append(line)

        threads = [threading.Thread(target=f, daemon=True) for f in (feed, read_stdout, read_stderr)]
        for thread in threads:
            thread.start()
        started = time.monotonic()

        def left() -> float:  # seconds until the run counts as stalled
            since = marks[-1] + REFERENCE_TIMEOUT + REFERENCE_MARGIN if marks else started + REFERENCE_STARTUP
            return since - time.monotonic()

        stalled = False
        try:
            while proc.poll() is None and not stalled:
                try:
                    proc.wait(timeout=min(0.5, max(0.01, left())))  # short: a new mark moves the deadline
                except subprocess.TimeoutExpired:
                    stalled = left() <= 0 and proc.poll() is None
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for thread in threads:
                thread.join()
    return None if stalled else proc.returncode, b"".join(out), b"".join(err)


def _failure_of(stderr: bytes, status: int) -> str:
    """Why the oracle run ended early: the problem it announced last, and its watchdog's verdict (with the line of
    the reference it was in) or the last line it wrote."""
    lines = stderr.decode("utf-8", "replace").splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(REFERENCE_MARK)]
    if not marks:
        return f"the oracle run failed before its first problem: {lines[-1][:200] if lines else f'exit {status}'}"
    task, after = lines[marks[-1]][len(REFERENCE_MARK):], lines[marks[-1] + 1:]
    if any(WATCHDOG_HEADER.fullmatch(line) for line in after):
        frames = [m for line in after if (m := WATCHDOG_FRAME.search(line))]
        at = f", at reference.py line {frames[0][1]} in {frames[0][2]}" if frames else ""
        return f"the reference solution of {task} ran over {REFERENCE_TIMEOUT:g}s{at}"
    why = after[-1][:200] if after else f"the oracle run ended early (exit {status})"
    return f"the reference solution of {task} failed: {why}"


def _stalled(stderr: bytes) -> str:
    lines = stderr.decode("utf-8", "replace").splitlines()
    marks = [line[len(REFERENCE_MARK):] for line in lines if line.startswith(REFERENCE_MARK)]
    if not marks:
        return f"the oracle run announced no problem within {REFERENCE_STARTUP:g}s of its start"
    return f"the reference solution of {marks[-1]} ran over {REFERENCE_TIMEOUT:g}s"


def run_references(rows: Sequence[dict[str, Any]]) -> dict[str, Oracle]:
    """task_id -> Oracle: every canonical solution on its inputs in one trusted subprocess (one interpreter start for
    the dataset, as EvalPlus computes its ground truth in one process), each under REFERENCE_TIMEOUT."""
    problems = [{"task_id": row["task_id"], "code": reference_code(row), "entry_point": row["entry_point"],
                 "inputs": problem_inputs(row)} for row in rows]
    job = json.dumps({"problems": problems, "inline_bytes": INLINE_BYTES, "timeout_s": REFERENCE_TIMEOUT,
                      "mark": REFERENCE_MARK})
    status, stdout, stderr = _run_oracle(job.encode())
    if status is None:
        raise LayerpruneError(_stalled(stderr))
    if status != 0 or not stdout:
        raise LayerpruneError(_failure_of(stderr, status))
    done, failure = pickle.loads(stdout)
    if failure is not None:
        raise LayerpruneError(f"the reference solution of {failure[0]} failed: {failure[1]}")
    return {task: Oracle(outputs, seconds, digests) for task, outputs, seconds, digests in done}


def expected_outputs(rows: Sequence[dict[str, Any]], cache_dir: Path | None) -> dict[str, Oracle]:
    """task_id -> Oracle, computed once per dataset content (cached under cache_dir) outside any candidate's budget."""
    path = cache_dir / f"expected-{dataset_hash(rows)[:24]}.pkl" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return {task: Oracle(**fields) for task, fields in pickle.loads(path.read_bytes()).items()}
        except Exception:  # a torn or foreign file: compute again
            pass
    start = time.perf_counter()
    oracles = run_references(rows)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps({task: asdict(o) for task, o in oracles.items()}, protocol=4))
        tmp.replace(path)
    seconds = time.perf_counter() - start
    if len(rows) > 1:
        print(f"HumanEval+ expected outputs of {len(rows)} problems computed in {seconds:.1f}s", file=sys.stderr)
    return oracles


def time_limits(oracle: Oracle, factor: float = GT_TIME_LIMIT_FACTOR, floor: float = MIN_TIME_LIMIT) -> list[float]:
    """EvalPlus's per-input limits: max(floor, factor x the reference's time on that input)."""
    return [max(floor, factor * t) for t in oracle.seconds]


def program_timeout(limits: Sequence[float], cap: float) -> float:
    """The whole program's wall limit: the inputs' limits summed, capped, plus start-up."""
    return min(cap, sum(limits)) + STARTUP_SLACK


def check_program(row: dict[str, Any], completion: str, oracle: Oracle, nonce: str) -> str:
    """A program that runs prompt + completion on every input under its time limit and checks each output."""
    inputs = problem_inputs(row)
    if len(inputs) != len(oracle.outputs):
        raise LayerpruneError(f"{row['task_id']}: {len(inputs)} inputs but {len(oracle.outputs)} expected outputs")
    expected = base64.b64encode(pickle.dumps(oracle.outputs, protocol=4)).decode()
    values = {"_NONCE": nonce, "_ENTRY": row["entry_point"], "_ATOL": float(row.get("atol") or 0),
              "_LIMITS": [round(x, 4) for x in time_limits(oracle)], "_DIGESTS": oracle.digests,
              "_CANDIDATE": row["prompt"] + completion}
    tail = [f"{name} = {value!r}" for name, value in values.items()]
    tail += [f"_INPUTS, _EXPECTED = _decode({json.dumps(inputs)!r}, {expected!r})", "_main()"]
    return programs_source() + "\n" + "\n".join(tail) + "\n"


def _verdict_line(result: Any, nonce: str) -> str | None:
    text = "\n".join(str(getattr(result, name, "") or "") for name in ("stdout", "stderr"))
    lines = [line[len(nonce) + 1:] for line in text.splitlines() if line.startswith(nonce + " ")]
    return lines[-1].strip() if lines else None


def judge(result: Any, nonce: str, n_inputs: int) -> Verdict:
    """The status of one run: a pass needs exit 0 AND the harness's last line saying every input was checked."""
    seconds = float(getattr(result, "seconds", 0.0) or 0.0)
    status = str(getattr(result, "status", "error"))
    line = _verdict_line(result, nonce)
    if status == "passed":
        if line == f"passed {n_inputs}":
            return Verdict("passed", f"{n_inputs} inputs checked", seconds)
        return Verdict("failed", "exited before its checks finished", seconds)
    if status == "failed" and line is not None:
        kind = line.split(" ", 1)[0]
        return Verdict(kind if kind in STATUSES else "failed", line, seconds)
    if status not in STATUSES:
        status = "error"
    stderr = str(getattr(result, "stderr", "") or "").strip().splitlines()
    return Verdict(status, line or (stderr[-1][:300] if stderr else status), seconds)


def check_completion(row: dict[str, Any], completion: str, oracle: Oracle,
                     limits: SandboxLimits | None = None) -> Verdict:
    """Run one completion against the problem's expected outputs in the sandbox."""
    limits = limits or SandboxLimits()
    nonce = f"layerprune-check-{secrets.token_hex(8)}"
    budget = program_timeout(time_limits(oracle), limits.timeout_s)
    bounded = replace(limits, timeout_s=budget)
    result = run_program(check_program(row, completion, oracle, nonce), bounded)
    return judge(result, nonce, len(oracle.outputs))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k)."""
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def count_statuses(items: Sequence[Any]) -> dict[str, int]:
    """lm-eval aggregation of the per-document status (one string, or a list of them when sampling)."""
    counts = {s: 0 for s in STATUSES}
    for item in items:
        for status in (item if isinstance(item, list) else [item]):
            counts[status] = counts.get(status, 0) + 1
    return {s: n for s, n in counts.items() if n}


def reference_lm(rows: Sequence[dict[str, Any]]) -> Any:
    """An lm-eval LM that answers each HumanEval+ prompt with that problem's canonical solution (nothing else)."""
    from lm_eval.api.model import LM

    solutions = {row["prompt"]: row.get("reference", row.get("canonical_solution")) for row in rows}

    class ReferenceLM(LM):  # type: ignore[misc]
        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
            out = []
            for request in requests:
                context = request.args[0]
                if context not in solutions:
                    raise LayerpruneError("--reference-solutions got a prompt that is no HumanEval+ problem's")
                out.append(solutions[context])
            return out

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> list[Any]:
            raise LayerpruneError("--reference-solutions scores HumanEval+ only")

        loglikelihood_rolling = loglikelihood

    return ReferenceLM()
