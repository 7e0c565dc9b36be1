"""The tasks `evaluate` knows: lm-eval's own tasks mapped onto local files, and this project's probes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from layerprune.core.registry import Registry
from layerprune.tasks.probes import probe_tasks

Kind = Literal["classification", "generative"]
# lm_eval_index: a name run by lm-eval's manager; boxed: the study's own GSM8K protocol (gsm8k_boxed_chat)
Source = Literal["lm_eval", "lm_eval_index", "probe", "humaneval", "boxed"]


@dataclass(frozen=True)
class TaskSpec:
    """How one task is run and which of its metrics is the headline number."""

    name: str
    kind: Kind
    source: Source
    metrics: tuple[str, ...]  # lm-eval result keys ("acc", "exact_match,strict-match"); the first is the headline
    # (empty: every metric lm-eval reports, in its order)
    dataset: str | None = None  # folder in the data mirror
    lm_eval_yaml: str | None = None  # path under lm_eval/tasks/
    splits: dict[str, str] = field(default_factory=dict)  # lm-eval split key -> split, as lm-eval's YAML says
    chat_protocol: bool = False  # --chat-template auto applies the template to this task
    optional: bool = False  # suites skip it when a data mirror is set up without it, or the hub is offline
    subtask_field: str | None = None  # a group (mmlu): lm-eval_yaml is a folder of subtasks, split by this column
    probe: dict[str, object] = field(default_factory=dict)  # arguments for layerprune.tasks.probes
    fixed_shots: bool = False  # the config lists its few-shot examples (fewshot_config.samples): no pool file

    @property
    def eval_split(self) -> str:
        return self.splits.get("test_split") or self.splits["validation_split"]

    @property
    def fewshot_split(self) -> str:
        """The split lm-eval draws few-shot examples from (its own rule: fewshot, train, validation, test)."""
        for key in ("fewshot_split", "training_split", "validation_split", "test_split"):
            if key in self.splits:
                return self.splits[key]
        raise KeyError(self.name)


TASKS: Registry[TaskSpec] = Registry("task")
ONLY_TEST = {"test_split": "test"}
# lm-eval's own split keys (its YAML); the mirror's files are named after the split: <data-dir>/<dataset>/<split>.jsonl
TRAIN_VALIDATION_TEST = {"training_split": "train", "validation_split": "validation", "test_split": "test"}
TRAIN_VALIDATION = {"training_split": "train", "validation_split": "validation"}
ACC = ("acc", "acc_norm")


def add_task(spec: TaskSpec) -> TaskSpec:
    return TASKS.register(spec.name)(spec)


for _name, _yaml, _splits, _metrics in [
    ("arc_easy", "arc/arc_easy.yaml", TRAIN_VALIDATION_TEST, ("acc_norm", "acc")),
    ("arc_challenge", "arc/arc_challenge.yaml", TRAIN_VALIDATION_TEST, ("acc_norm", "acc")),
    ("hellaswag", "hellaswag/hellaswag.yaml", TRAIN_VALIDATION, ("acc_norm", "acc")),
    ("piqa", "piqa/piqa.yaml", TRAIN_VALIDATION, ("acc_norm", "acc")),
    ("winogrande", "winogrande/default.yaml", TRAIN_VALIDATION, ("acc",)),
    ("boolq", "super_glue/boolq/default.yaml", TRAIN_VALIDATION, ("acc",)),
    ("openbookqa", "openbookqa/openbookqa.yaml", TRAIN_VALIDATION_TEST, ("acc_norm", "acc")),
]:
    add_task(TaskSpec(_name, "classification", "lm_eval", _metrics, _name, _yaml, _splits))

# MMLU: lm-eval's 57 subject tasks (mmlu/default), aggregated as lm-eval's `mmlu` group does (weighted by size).
# Locally it reads the hub's "all" config: <data-dir>/mmlu/{test,dev}.jsonl with a `subject` column.
add_task(TaskSpec("mmlu", "classification", "lm_eval", ("acc",), "mmlu", "mmlu/default",
                  {"test_split": "test", "fewshot_split": "dev"}, optional=True, subtask_field="subject"))
add_task(TaskSpec("gsm8k", "generative", "lm_eval", ("exact_match,strict-match", "exact_match,flexible-extract"),
                  "gsm8k", "gsm8k/gsm8k.yaml", {"fewshot_split": "train", "training_split": "train",
                                                "test_split": "test"}, chat_protocol=True))
add_task(TaskSpec("triviaqa", "generative", "lm_eval", ("exact_match,remove_whitespace",), "triviaqa",
                  "triviaqa/default.yaml", {"training_split": "train", "validation_split": "validation"},
                  chat_protocol=True, optional=True))
add_task(TaskSpec("humaneval_plus", "generative", "humaneval", ("pass@1",), "humaneval_plus",
                  splits=ONLY_TEST))
# The pruning study's own GSM8K protocol: zero-shot, chat template, a \boxed{} answer, sampling at 0.9, long answers
add_task(TaskSpec("gsm8k_boxed_chat", "generative", "boxed", ("exact_match",), "gsm8k", splits=ONLY_TEST,
                  chat_protocol=True))

for _name, _args in probe_tasks().items():
    add_task(TaskSpec(_name, "generative", "probe", ("exact_match",), probe=_args))
