"""The run's last model, made to be served: a Q8_0 GGUF for llama.cpp / Ollama, and the vLLM serving check.

The export stage writes gguf/model.gguf and gguf/export.json (its record, also when the export is refused or vLLM
is missing: the run goes on and the report says why and what to run instead).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.settings import RunSettings

GGUF_TYPE = "q8_0"


def final_model(root: Path) -> Path:
    """The recovered model when the run recovered one, else the pruned one."""
    recovered = root / "recovered"
    return recovered if (recovered / "config.json").is_file() else root / "pruned"


def run_export(root: Path, folder: Path, settings: RunSettings) -> None:
    """Export the final model to folder/model.gguf and run the serving check where vLLM is installed."""
    from layerprune.export import export_gguf

    model, record = final_model(root), {}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        report = export_gguf(model, folder / "model.gguf", GGUF_TYPE, overwrite=True, settings=settings)
        record["gguf"] = report.model_dump(mode="json")
    except LayerpruneError as exc:
        record["gguf_refused"] = one_line(exc)
    record["model"] = str(model)
    record["serve_check"] = _serve_check(model, settings)
    (folder / "export.json").write_text(json.dumps(record, indent=2))


def _serve_check(model: Path, settings: RunSettings) -> dict[str, Any]:
    """In the vLLM Python the settings or $LAYERPRUNE_VLLM_PYTHON name (make demo: .venv-vllm's), else here."""
    python = settings.resolved_vllm_python()
    if python is not None:
        from layerprune.pipeline.serve_subprocess import serve_check_in

        result = serve_check_in(python, model, settings)
        if "not_run" in result:
            return result
    elif importlib.util.find_spec("vllm") is None:
        return {"not_run": "vLLM is not installed here and no vLLM Python is named (LAYERPRUNE_VLLM_PYTHON)"}
    else:
        from layerprune.models.serving import check_serve

        try:
            result = check_serve(model, settings)
        except LayerpruneError as exc:
            return {"not_run": one_line(exc)}
    keys = ("engine", "dtype", "verdict", "equal", "of", "passed", "engine_start_s")
    return {key: result[key] for key in keys if key in result}


def serving_lines(folder: Path) -> list[str]:
    """The report's section: the GGUF file, the commands that chat with it, the vLLM serving check."""
    path = folder / "export.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    lines = ["", "## Run it", ""]
    gguf = record.get("gguf")
    if gguf:
        back = gguf.get("readback") or {}
        reads = f"{back['verdict']}, " if "verdict" in back else ""
        lines += [f"`{gguf['output']}` ({gguf['outtype']}, {gguf['bytes'] / 1e6:.0f} MB; read back by transformers: "
                  f"{reads}top-1 {back.get('top1_agreement', '?')}, "
                  f"max |logit diff| {back.get('max_abs_logit_diff', '?')}).",
                  "", f"- llama.cpp: `llama-cli -m {gguf['output']} -cnv`",
                  f"- Ollama: a `Modelfile` with `FROM {gguf['output']}`, then `ollama create pruned -f Modelfile` "
                  "and `ollama run pruned` (the chat template is in the GGUF)"]
    else:
        lines.append(f"No GGUF: {record.get('gguf_refused')}.")
    check = record["serve_check"]
    if "not_run" in check:
        lines.append(f"- vLLM serving check not run ({check['not_run']}): `layerprune check-serve {record['model']}` "
                     "where vLLM is installed (make vllm-install; `make demo` then runs it in .venv-vllm)")
    else:
        verdict = "passed" if check["passed"] else "FAILED"
        reads = f" reads {check['verdict']} against transformers and" if "verdict" in check else ""
        lines.append(f"- vLLM serving check {verdict}: {check['engine']} ({check['dtype']}){reads} continues "
                     f"{check['equal']}/{check['of']} verification prompts as transformers does; serve with "
                     f"`vllm serve {record['model']}`")
    return lines
