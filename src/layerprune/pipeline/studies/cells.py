"""What every study kind shares, below all of them: the names of its cells and files (replicate labels, the chat-format
evaluation's prefix, the probe gate's file), a recovery arm and how its recipe derives from the shared one, and the
steps that run a cell (the probe gate, one replicate's recovery sharing the teacher answers, the dry runs' measured
rates). The study kinds (sweep_grid, grain_grid, variant_grid) and their runners and reports import it; it imports
none of them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import merge_layers
from layerprune.core.settings import RunSettings
from layerprune.evaluate.calibrated import ProbeCalibration
from layerprune.evaluate.schema import EvalSettings
from layerprune.recover.schema import RecoverRecipe
from layerprune.tasks.data import iter_jsonl

if TYPE_CHECKING:
    from layerprune.pipeline.recipe import PipelineRecipe

log = logging.getLogger(__name__)


CHAT_EVAL = "eval-chat/"  # the chat-format probe evaluation: stage eval-chat/<label>, folder eval-chat/<label>/


class Arm(BaseModel):
    """One recovery method: the method and its own section; everything else comes from the shared recipe. Besides
    `lora`, an arm may set the fields of any registered method's recipe section under its name (kd, opd, replace,
    merge, local...); any other key is an error."""

    model_config = ConfigDict(extra="allow")

    method: str = Field(description="Recover method: lora, full, qlora, kd, opd, replace, merge or local")
    lora: dict[str, Any] = Field(default_factory=dict, description="LoRA fields of this arm")
    learning_rate: float | None = Field(None, gt=0, description="Peak learning rate of this arm (default: shared)")

    @model_validator(mode="after")
    def _method_sections(self) -> Arm:
        from layerprune.recover.methods import METHODS

        known = sorted(METHODS.get(name).section for name in METHODS if METHODS.get(name).section)
        for key, value in (self.model_extra or {}).items():
            if key not in known:
                raise ValueError(f"arm key '{key}' is neither an arm field nor a method's section ({', '.join(known)})")
            if not isinstance(value, dict):
                raise ValueError(f"arm section '{key}' must be a mapping of that section's fields")
        self.__pydantic_extra__ = {key: value for key, value in (self.model_extra or {}).items() if value}
        return self  # an empty section is the default: it changes no fingerprint

    def sections(self) -> dict[str, dict[str, Any]]:
        """The recipe sections this arm sets (lora and its methods' own), by section name."""
        return {"lora": self.lora, **(self.model_extra or {})}


def check_plain_probes(evaluate: EvalSettings, shared: RecoverRecipe) -> None:
    """A study or sweep whose recovery data is chat-formatted scores its probes in both formats itself: a recipe
    asking for chat-format probes is refused."""
    if evaluate.probe_format == "chat" and shared.generate.chat_template:
        raise ValueError("evaluate.probe_format: leave it plain; with chat-formatted recovery data "
                         "(generate.chat_template) the probes are scored in chat format too")


def derive_arm_recipe(shared: RecoverRecipe, arm: Arm, name: str, probe_seed: int) -> RecoverRecipe:
    """The shared recover recipe with an arm's method, its own section and learning rate, named `name`, and never a
    prompt of the evaluation's probe seed (a sweep's arms and a grain study's alike)."""
    base = shared.model_dump(mode="json")
    layer: dict[str, Any] = {"name": name, "method": arm.method,
                             **{k: v for k, v in arm.sections().items() if v}}
    if arm.learning_rate is not None:
        layer["train"] = {"learning_rate": arm.learning_rate}
    seeds = sorted({*base["prompts"]["exclude_probe_seeds"], probe_seed})
    layer["prompts"] = {"exclude_probe_seeds": seeds}  # never a prompt the evaluation will ask
    return RecoverRecipe.model_validate(merge_layers(base, layer))


def replicate_label(label: str, replicate: int) -> str:
    """The folder and stage name of an arm's replicate: the label itself for replicate 0, else label@r<r>."""
    return label if replicate == 0 else f"{label}@r{replicate}"


def check_chat_template(model: str | None, settings: RunSettings) -> str:
    """'chat template: present' where the original's tokenizer has one; an error where it has none (the probes are
    scored in chat format too, and probe_format chat refuses such a model); a note where it cannot be read here."""
    from layerprune.models import resolve_model
    from layerprune.models.loading import load_tokenizer

    source = resolve_model(model or "embedded", settings)
    try:
        tokenizer = load_tokenizer(source, settings)
    except LayerpruneError as exc:
        if source.is_local:
            raise
        return f"chat template: not checked from here ({str(exc)[:80]})"
    if not getattr(tokenizer, "chat_template", None):
        raise LayerpruneError(f"{source.spec} has no chat template: the recovery data is chat-formatted "
                              "(generate.chat_template), so the probes are scored with probe_format chat too, "
                              "which needs one; set generate.chat_template: false or use a model with a template")
    return "chat template: present"


def split_label(name: str) -> tuple[str, int]:
    """'sft@r2' -> ('sft', 2); 'sft' -> ('sft', 0)."""
    label, _, replicate = name.partition("@r")
    return label, int(replicate or 0)


def data_dir_of(study: PipelineRecipe) -> Path | None:
    """Where a study's recoveries read their prompts: the evaluation's data folder, else the prune's."""
    return study.evaluate.data_dir or study.prune.data_dir


def replicate_settings(settings: RunSettings, replicate: int) -> RunSettings:
    """Replicate r's run settings: the run seed + r (replicate 0: the run seed itself)."""
    return settings.model_copy(update={"seed": settings.seed + replicate})


def teacher_answers(recipe: RecoverRecipe, replicate: int) -> str:
    """The teacher-answer file a replicate shares with the other runs of a study or sweep: greedy answers
    (temperature 0) are the same for every replicate (one file), sampled ones are drawn with each replicate's seed."""
    return replicate_label("selfgen", replicate if recipe.generate.temperature > 0 else 0) + ".jsonl"


def recover_sharing_answers(recipe: RecoverRecipe, job: Any, shared: Path) -> None:
    """recover_model, starting from the teacher answers in `shared` (an earlier run's), and leaving there the most
    answers any run produced: the teacher answers each prompt once per study. The process's random state is seeded
    with the job's seed first: what no recover seed reaches (TRL builds the LoRA adapters, and so draws their
    initialisation, before the trainer seeds itself) follows the replicate's seed too."""
    import transformers

    from layerprune.recover.runner import recover_model

    transformers.set_seed(job.settings.seed)
    if shared.is_file() and not (job.work / "responses.jsonl").exists():
        job.work.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shared, job.work / "responses.jsonl")
    recover_model(recipe, job)
    produced = job.output / "data" / "responses.jsonl"
    if produced.is_file() and _count(produced) > _count(shared):
        shutil.copy2(produced, shared)


def _count(path: Path) -> int:
    return sum(1 for _ in iter_jsonl(path)) if path.is_file() else 0


CALIBRATION_FILE = "probes_calibrated.json"


SEARCH_REPLICATE = 1000  # the learning-rate search's seed offset: settings.seed + 1000, no scored replicate's


def calibrate(model: str | None, probes: ProbeCalibration, settings: RunSettings, root: Path) -> None:
    """The probe gate (the sweep's stage): which candidate levels the original `model` can
    do, on the calibration stream (less what a variant `model` was trained on), in root/probes_calibrated.json."""
    from layerprune.core.outputs import write_atomic
    from layerprune.evaluate.calibrated import calibrate_probes
    from layerprune.models import load_model
    from layerprune.posttrain.api import trained_questions

    loaded = load_model(model, settings)
    trained = trained_questions(Path(loaded.source.location)) if loaded.source.is_local else frozenset()
    record = calibrate_probes(loaded.model, loaded.tokenizer, probes, lambda m: log.info("  %s", m), trained=trained)
    write_atomic(root / CALIBRATION_FILE, json.dumps(record, indent=1))


RATES = {"classification docs/s": 3.4, "probe items/s": 8.0, "trained tokens/s": 170.0, "gsm8k items/s": 0.14,
         "calibration items/s": 8.0, "teacher tokens/s": 90.0,  # measured on 2 idle cores (docs/benchmarks.md)
         "local tokens/s": 340.0,  # the local step, one block on cached states (recovery-transfer-embedded)
         "target tokens/s": 76.0,  # unpadded target tokens, LoRA SFT or kd (recovery-transfer-replicated: 16k, 210 s)
         "scoring candidate-items/s": 7.6,  # a one-shot ablation pass: the demo's 30 blocks x 32 items in 126 s
         "forward tokens/s": 369.0}  # one sequence at a time, no grad: held-out rows, local's teacher states


def rates_apply(model: str | None) -> bool:
    """The measured 2-core rates hold for the embedded SmolLM2 and for a variant post-trained from it (the same
    architecture)."""
    spec = str(model or "embedded")
    if spec.startswith("variant:"):
        from layerprune.core.recipe_loading import build_from_recipe
        from layerprune.posttrain.schema import VariantRecipe

        spec = build_from_recipe(VariantRecipe, "variant", spec.partition(":")[2], {}).model
    return spec.startswith("embedded")


def suite_tasks(suite: str) -> list[str]:
    """The leaf tasks of a suite."""
    from layerprune.evaluate.suites import expand

    return [name for name, _ in expand(suite)]
