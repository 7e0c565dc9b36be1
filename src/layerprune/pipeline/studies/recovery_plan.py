"""The recoveries' part of the dry run (sweep_plan.py frames it): what each arm's runs train (target tokens, schedule
and rate), their held-out evaluations and the teacher states a block-training arm captures, and with budgets each
arm's runs and points, at the measured 2-core rates (cells.RATES)."""

from __future__ import annotations

from layerprune.pipeline.studies.cells import RATES
from layerprune.pipeline.studies.sweep import states_folder
from layerprune.pipeline.studies.sweep_grid import (
    DEDICATED,
    SweepStudy,
    arm_names,
    budget_tag,
    dedicated_points,
    has_control,
    trains_each_budget,
)
from layerprune.recover.schema import RecoverRecipe

PROMPT_TOKENS = 60  # the plan's prompt (chat template included) beside each teacher answer of max_new_tokens


def answers(recipe: RecoverRecipe) -> int:
    """The teacher answers a recovery plans for (prompts.samples; 256 where it takes every prompt)."""
    return recipe.prompts.samples or 256


def sequence_tokens(recipe: RecoverRecipe) -> int:
    """The tokens of one planned training sequence: the prompt and an answer of max_new_tokens."""
    return recipe.generate.max_new_tokens + PROMPT_TOKENS


def learning_rate(recipe: RecoverRecipe) -> float | None:
    """The rate of the schedule `training` words: its trainer's, else its local step's (unset: train's); None where
    nothing trains."""
    section = recipe.lr_section()
    if section is None:
        return None
    rate = None if recipe.trainer_method() is not None else getattr(recipe, section).learning_rate
    return float(recipe.train.learning_rate if rate is None else rate)


def training(recipe: RecoverRecipe) -> tuple[float, str, float]:
    """One recovery's plan: the tokens it trains (sequence_tokens a teacher answer), its schedule in words (its rate
    apart: `learning_rate`), and the measured CPU rate it trains at (the local step on cached states has its own)."""
    train, per_answer, planned = recipe.train, sequence_tokens(recipe), answers(recipe)
    if recipe.trainer_method() is None and recipe.lr_section() is not None:
        # the local step's own budget: local.steps (else train.max_steps, else one pass) of batch x accum
        from layerprune.recover.chain import local_budget

        budget = local_budget(recipe, int(planned * (1 - train.held_out)))
        trained = budget.steps * budget.sequences_per_step * per_answer
        if train.max_tokens is not None:
            trained = min(trained, train.max_tokens)
        return trained, f"{budget.steps} local steps", RATES["local tokens/s"]
    if recipe.trainer_method() is None:
        return 0.0, "no training (forward passes only)", RATES["trained tokens/s"]
    trained = planned * (1 - train.held_out) * per_answer * train.epochs if train.max_steps is None else \
        train.max_steps * train.batch_size * train.grad_accum * per_answer
    schedule = f"{train.epochs:g} epochs" if train.max_steps is None else f"{train.max_steps} optimizer steps"
    if train.max_tokens is not None:  # target (answer) tokens: sequence_tokens / max_new_tokens trained a token
        trained = min(trained, train.max_tokens * per_answer / recipe.generate.max_new_tokens)
        schedule += f" or {train.max_tokens} target (answer) tokens, whichever comes first"
    return trained, schedule, RATES["trained tokens/s"]


def run_tokens(study: SweepStudy, arm: str | None, plans: dict[str | None, tuple[float, str, float]],
                runs: dict[str | None, int]) -> list[float]:
    """The target tokens of each of an arm's runs (with budgets: budget_runs; else its plan, every run alike)."""
    if study.budgets:
        return [float(t) for t in budget_runs(study, arm)]
    recipe = study.arm_recipe(arm, "<pruned>")
    return [plans[arm][0] * recipe.generate.max_new_tokens / sequence_tokens(recipe)] * runs[arm]


def held_out_seconds(study: SweepStudy, arm: str | None, runs: list[float]) -> float:
    """An arm's held-out evaluations (`runs`: each run's target tokens), one sequence at a time at the measured
    forward rate: the teacher once a run (kept on the CPU), the student before training, after the block-changing
    steps, every eval_steps of a trainer, and after; SFT's trainer also at its start and its last step, before the
    runner measures the saved weights (its own evaluations batch the rows: counted alike, an upper bound)."""
    from layerprune.recover.methods import METHODS

    recipe = study.arm_recipe(arm, "<pruned>")
    per_target, new = sequence_shape(study, arm)
    train = recipe.train
    held = answers(recipe) * train.held_out * new * per_target
    per_step = train.batch_size * train.grad_accum * new
    trainer = recipe.trainer_method() is not None
    own = 2 if trainer and not METHODS.get(recipe.method).needs_teacher else 0  # SFT: eval_on_start and last step
    evals = [3 + own + bool(recipe.surgery_steps()) + (int(t // per_step // train.eval_steps) if trainer else 0)
             for t in runs]
    return sum(evals) * held / RATES["forward tokens/s"]


def states_seconds(study: SweepStudy, arm: str | None) -> float:
    """The teacher states a block-training arm (local) captures: one forward per training sequence and dropped
    block (half the model deep on average), once a cut and seed where its runs share them (sweep.states_folder: a
    run per budget; the lr grid's runs), else once a run."""
    recipe = study.arm_recipe(arm, "<pruned>")
    if not any(method.caches_states for method in recipe.chain_methods()):
        return 0.0
    tokens = answers(recipe) * (1 - recipe.train.held_out) * sequence_tokens(recipe)
    grid = len(study.lr_grid.get(arm or "", []))
    searches = (1 if states_folder(study, study.run_dir(), arm, search=True) else grid) * study.lr_k
    dedicated = len(dedicated_points(study, study.lr_k, arm)) * study.lr_k if study.dedicated_at else 0
    forwards = sum(k * study.replicates for k in study.ratios) + searches + dedicated  # a run per budget: shared
    return forwards / 2 * tokens / RATES["forward tokens/s"]


def budget_runs(study: SweepStudy, arm: str | None) -> list[int]:
    """The target tokens of every run of an arm with budgets: each replicate at every k to the largest budget (local
    also to each smaller one, a run of its own), the controls to the largest, the lr grid's runs to the smallest."""
    own = study.budgets_of(arm)
    largest, smallest = own[-1], own[0]
    per_point = own if trains_each_budget(study, arm) else [largest]
    points = len(study.ratios) * study.replicates * per_point
    control = [largest] * study.replicates if has_control(study, arm) else []
    dedicated = [study.dedicated_at] * len(dedicated_points(study, study.lr_k, arm)) if study.dedicated_at else []
    return [*points, *control, *dedicated, *[smallest] * len(study.lr_grid.get(arm or "", []))]


def measured_sequences(study: SweepStudy, arm: str | None) -> tuple[float, float] | None:
    """(trained tokens a target token, target tokens a sequence) of the arm's answers as its learning-rate search's
    first run trained on them (recover_report.json: tokens_padded / tokens_unpadded, tokens_unpadded / sequences);
    None before that run, or without a search."""
    import json

    report = study.run_dir() / "lr_search" / str(arm) / "lr0" / "recover_report.json"
    if arm is None or not report.is_file():
        return None
    data = json.loads(report.read_text())
    target, padded, sequences = (data.get(k) for k in ("tokens_unpadded", "tokens_padded", "sequences"))
    return (padded / target, target / sequences) if target and padded and sequences else None


def sequence_shape(study: SweepStudy, arm: str | None) -> tuple[float, float]:
    """(tokens trained a target token, target tokens a sequence): measured (`measured_sequences`), else planned as
    sequence_tokens / max_new_tokens and max_new_tokens (every answer as long as it may be: a lower bound on the cost
    where the answers are short)."""
    recipe = study.arm_recipe(arm, "<pruned>")
    new = recipe.generate.max_new_tokens
    return measured_sequences(study, arm) or (sequence_tokens(recipe) / new, float(new))


def budget_seconds(study: SweepStudy, arm: str | None) -> float:
    """The arm's training time with budgets at the measured rates, `sequence_shape`'s trained tokens a target
    token."""
    rate = RATES["local tokens/s"] if trains_each_budget(study, arm) else RATES["trained tokens/s"]
    return sum(budget_runs(study, arm)) * sequence_shape(study, arm)[0] / rate


def most_spans(study: SweepStudy) -> tuple[int, str]:
    """The most spans (runs of adjacent dropped blocks) any k's cut has, and how it is known: from the scoring
    pass's ranking where its run has one, else as if every dropped block were apart (local trains a block per span,
    local.steps shared out over them)."""
    from layerprune.pipeline.studies.sweep_inputs import ranking
    from layerprune.recover.local import contiguous

    root = study.run_dir()
    if study.prune.layers is None and not (root / "scored" / "prune_report.json").is_file():
        return max(study.ratios), "at most (the blocks not ranked yet: as if every dropped block were apart)"
    cuts = ranking(root, study.ratios, study.prune.layers).values()
    return max(1, *(len(contiguous(sorted(cut))) for cut in cuts)), "at most"


def budget_lines(study: SweepStudy) -> list[str]:
    """The budget points, how each is made, and where an arm's epochs (local: steps) cannot reach the largest."""
    if not study.budgets:
        return []
    largest = study.budgets[-1]
    lines = [f"budget points (unpadded target tokens): {', '.join(map(str, study.budgets))}; every recovery at k > 0 "
             f"trains to {largest} (train.max_tokens; the k = 0 controls too, their only point), scored at each "
             f"budget as ARM-kK@<budget>[@rR] ({', '.join(budget_tag(b) for b in study.budgets[:-1])}; the largest is "
             f"ARM-kK itself)" + (f"; lr grids searched at {study.budgets[0]}" if study.lr_grid else "")
             + (f"; a dedicated run of every trainer arm at {study.dedicated_at} and k = {study.lr_k} beside its "
                f"checkpoint (ARM-k{study.lr_k}@{budget_tag(study.dedicated_at)}{DEDICATED}[@rR])"
                if study.dedicated_at else "")]
    for arm in arm_names(study):
        recipe, name = study.arm_recipe(arm, "<pruned>"), arm or "the recovery"
        trained = int(answers(recipe) * (1 - recipe.train.held_out))
        new, train = recipe.generate.max_new_tokens, recipe.train
        if trains_each_budget(study, arm):
            from layerprune.recover.chain import local_budget

            steps, spans = local_budget(recipe, trained), most_spans(study)
            reach = steps.steps // spans[0] * steps.sequences_per_step * new
            how = "a run of its own per budget (no trainer to save checkpoints)"
            more = f"local.steps, shared out over the cut's spans: {spans[0]} {spans[1]}"
        else:
            reach = int(train.epochs * trained * new) if train.max_steps is None else \
                train.max_steps * train.batch_size * train.grad_accum * new
            how = (f"checkpoints of the one run (a trainer callback counts the target tokens of each batch and saves "
                   f"the step that first reaches a budget), lr {train.lr_scheduler} after {train.warmup_steps} warmup "
                   "steps")
            more = "train.epochs" if train.max_steps is None else "train.max_steps"
        runs, own = budget_runs(study, arm), study.budgets_of(arm)
        lines.append(f"arm {name}: budget points as {how}; {len(runs)} runs, {sum(runs) / 1000:.0f}k target tokens "
                     f"in all" + (f"; its own budgets (arm_budgets): {', '.join(map(str, own))}, its runs and "
                                  f"control to {own[-1]}" if own != study.budgets else "")
                     + ("" if reach >= own[-1] else f"; WARNING: at most {reach} target tokens reachable "
                        f"({trained} answers of at most {new} tokens): raise {more}"))
    return lines
