"""HumanEval+ scored as EvalPlus scores it.

- Expected outputs come from the dataset's canonical solution, run once per problem in a trusted subprocess
  (outside any candidate's budget) and cached by the dataset's content hash, with the time each input took.
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
import hashlib
import json
import os
import pickle
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from layerprune.errors import LayerpruneError
from layerprune.evaluate.sandbox import SandboxLimits, run_program

# EvalPlus's defaults (evalplus/config.py; untrusted_check)
GT_TIME_LIMIT_FACTOR = 4.0
MIN_TIME_LIMIT = 1.0
TASK_TIMEOUT_CAP = 60.0
STARTUP_SLACK = 2.0  # interpreter start and loading the inputs, on top of the inputs' limits
REFERENCE_TIMEOUT = 600.0
ORACLE_VERSION = "3"  # part of the cache key: bump when the way expected outputs are computed changes
STATUSES = ("passed", "failed", "timeout", "memory", "blocked", "killed", "error")
INLINE_BYTES = 64 << 10  # an expected output larger than this (pickled) is carried as a digest, not its value

# A digest under which equal outputs (as `==` sees them for these types: 1 == 1.0 == True, dict and set order
# ignored) agree. Large outputs (HumanEval/15 and /130 return megabytes) are compared by it, as embedding them
# made 100-200 MB programs. The same source runs in the reference runner and in the check program.
DIGEST_SOURCE = r"""
import hashlib as _hashlib, math as _dmath


def _canon(x, h):
    t = type(x)
    if x is None:
        h.update(b"N")
    elif t in (bool, int) or (t is float and _dmath.isfinite(x) and x == int(x)):
        n = int(x)
        h.update(b"n" + n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True) + b";")
    elif t is float:
        h.update(b"f" + repr(x).encode() + b";")
    elif t is str:
        data = x.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data) + data)
    elif t in (list, tuple):
        h.update((b"l" if t is list else b"t") + b"%d[" % len(x))
        for item in x:
            _canon(item, h)
        h.update(b"]")
    elif t in (set, frozenset):
        h.update(b"S" + b"".join(sorted(_digest(item).encode() for item in x)))
    elif t is dict:
        h.update(b"d" + b"".join(sorted((_digest(k) + _digest(v)).encode() for k, v in x.items())))
    else:
        h.update(b"o" + t.__name__.encode() + b":" + repr(x).encode("utf-8", "replace"))


def _digest(x):
    h = _hashlib.sha256()
    _canon(x, h)
    return h.hexdigest()
"""

REFERENCE_RUNNER = DIGEST_SOURCE + r'''
import copy, json, pickle, sys, time
job = json.loads(sys.stdin.read())
out = sys.stdout.buffer
sys.stdout = sys.stderr
namespace = {}
exec(compile(job["code"], "reference.py", "exec"), namespace)
fn = namespace[job["entry_point"]]
outputs, seconds = [], []
for args in job["inputs"]:
    args = copy.deepcopy(args)
    start = time.time()
    outputs.append(fn(*args))
    seconds.append(time.time() - start)
digests = []
for i, value in enumerate(outputs):
    big = len(pickle.dumps(value, protocol=4)) > job["inline_bytes"]
    digests.append(_digest(value) if big else None)
    outputs[i] = None if big else value
out.write(pickle.dumps((outputs, seconds, digests), protocol=4))
'''

CHECK_PROGRAM = DIGEST_SOURCE.replace("{", "{{").replace("}", "}}") + r'''
import base64 as _b64, cmath as _cmath, io as _io, json as _json, math as _math, os as _os, pickle as _pickle
import signal as _signal
import sys as _sys

_NONCE = {nonce!r}
_ENTRY = {entry_point!r}
_ATOL = {atol!r}
_LIMITS = {limits!r}
_INPUTS = _json.loads({inputs!r})
_EXPECTED = _pickle.loads(_b64.b64decode({expected!r}))
_DIGESTS = {digests!r}
_CANDIDATE = {candidate!r}


def _say(line):
    data = (_NONCE + " " + line + "\n").encode("utf-8", "replace")
    for fd in (1, 2):
        try:
            _os.write(fd, data)
        except OSError:
            pass


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _poly(xs, x):
    return sum([coeff * _math.pow(x, i) for i, coeff in enumerate(xs)])


def _is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    return False


def _same(out, exp, inp, atol):
    exact = out == exp
    if _ENTRY == "find_zero":
        return abs(_poly(*inp, out)) <= atol
    if atol == 0 and _is_floats(exp):
        atol = 1e-6
    if not exact and atol != 0:
        if type(out) != type(exp) or (isinstance(exp, (list, tuple)) and len(out) != len(exp)):
            return False
        return _allclose(out, exp, atol)
    return bool(exact)


def _allclose(out, exp, atol, rtol=1e-07):
    # numpy.allclose(out, exp, rtol, atol) for numbers and equal-shaped nested sequences, in plain Python (the
    # sandbox may not import numpy): |out - exp| <= atol + rtol * |exp|, NaN never close, infinities only to themselves
    if isinstance(exp, (list, tuple)) or isinstance(out, (list, tuple)):
        if not (isinstance(exp, (list, tuple)) and isinstance(out, (list, tuple))) or len(out) != len(exp):
            return False
        return all(_allclose(o, e, atol, rtol) for o, e in zip(out, exp))
    if isinstance(out, str) or isinstance(exp, str):
        raise TypeError("not numbers")
    if _cmath.isinf(out) or _cmath.isinf(exp):
        return out == exp
    return abs(out - exp) <= atol + rtol * abs(exp)


def _main():
    sink = _io.StringIO()
    _sys.stdout = _sys.stderr = sink
    _sys.stdin = _io.StringIO()
    _signal.signal(_signal.SIGALRM, _alarm)
    namespace = {{}}
    try:
        exec(compile(_CANDIDATE, "candidate.py", "exec"), namespace)
        fn = namespace[_ENTRY]
    except BaseException as exc:
        _say("failed load " + type(exc).__name__ + ": " + str(exc)[:300].replace("\n", " "))
        _os._exit(1)
    for i, inp in enumerate(_INPUTS):
        try:
            _signal.setitimer(_signal.ITIMER_REAL, _LIMITS[i])
            try:
                out = fn(*inp)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            _say("timeout %d over %.2fs" % (i, _LIMITS[i]))
            _os._exit(3)
        except MemoryError:
            _say("memory %d" % i)
            _os._exit(4)
        except BaseException as exc:
            _say("failed %d raised %s: %s" % (i, type(exc).__name__, str(exc)[:300].replace("\n", " ")))
            _os._exit(1)
        try:
            if _DIGESTS[i] is not None:
                same = _digest(out) == _DIGESTS[i]
            else:
                same = _same(out, _EXPECTED[i], inp, _ATOL)
        except BaseException:
            same = False
        if not same:
            _say("failed %d wrong output" % i)
            _os._exit(1)
    _say("passed %d" % len(_INPUTS))  # then return: the sandbox's own pass needs the program to end normally


_main()
'''


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


def run_reference(row: dict[str, Any]) -> Oracle:
    """Run the canonical solution on every input in a trusted subprocess; its outputs and per-input seconds."""
    job = json.dumps({"code": reference_code(row), "entry_point": row["entry_point"], "inputs": problem_inputs(row),
                      "inline_bytes": INLINE_BYTES})
    try:
        proc = subprocess.run([sys.executable, "-I", "-B", "-c", REFERENCE_RUNNER], input=job.encode(),
                              capture_output=True, timeout=REFERENCE_TIMEOUT, env=_reference_env())
    except subprocess.TimeoutExpired as exc:
        raise LayerpruneError(f"the reference solution of {row['task_id']} ran over {REFERENCE_TIMEOUT:g}s") from exc
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        raise LayerpruneError(f"the reference solution of {row['task_id']} failed: {tail[0][:200]}")
    outputs, seconds, digests = pickle.loads(proc.stdout)
    return Oracle(outputs, seconds, digests)


def expected_outputs(rows: Sequence[dict[str, Any]], cache_dir: Path | None) -> dict[str, Oracle]:
    """task_id -> Oracle, computed once per dataset content (cached under cache_dir) outside any candidate's budget."""
    path = cache_dir / f"expected-{dataset_hash(rows)[:24]}.pkl" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return {task: Oracle(**fields) for task, fields in pickle.loads(path.read_bytes()).items()}
        except Exception:  # a torn or foreign file: compute again
            pass
    start = time.perf_counter()
    oracles = {row["task_id"]: run_reference(row) for row in rows}
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
    return CHECK_PROGRAM.format(
        nonce=nonce, entry_point=row["entry_point"], atol=float(row.get("atol") or 0),
        limits=[round(x, 4) for x in time_limits(oracle)], inputs=json.dumps(inputs), expected=expected,
        candidate=row["prompt"] + completion, digests=oracle.digests,
    )


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
