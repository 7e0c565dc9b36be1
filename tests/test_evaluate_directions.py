"""lm-eval's lower-is-better metrics (perplexity) and scores outside [0, 1] never head a task, so they never join
the accuracies' averages or read as a drop with the sign inverted."""

from __future__ import annotations

from layerprune.evaluate.lm_eval_results import summarize
from layerprune.evaluate.report import average_rows, comparison_rows
from layerprune.evaluate.summary import EvaluatedModel, Summary
from layerprune.evaluate.task_specs import TaskSpec

INDEX_TASK = TaskSpec("wikitext", "classification", "lm_eval_index", ())


def raw(word_ppl: float, acc: float | None = None) -> dict:
    scores = {"alias": "wikitext", "word_perplexity,none": word_ppl, "word_perplexity_stderr,none": "N/A",
              "bits_per_byte,none": 0.8, "bits_per_byte_stderr,none": "N/A"}
    directions = {"word_perplexity": False, "bits_per_byte": False}
    if acc is not None:
        scores.update({"bleu,none": 31.0, "acc,none": acc, "acc_stderr,none": 0.01})
        directions.update({"bleu": True, "acc": True})
    return {"results": {"wikitext": scores}, "higher_is_better": {"wikitext": directions},
            "n-samples": {"wikitext": {"effective": 62, "original": 62}}}


def test_a_perplexity_task_has_no_headline_and_joins_no_average():
    rows = summarize(INDEX_TASK, raw(30.0), {}, 1.0)
    assert [r.metric for r in rows] == ["word_perplexity", "bits_per_byte"] and not any(r.headline for r in rows)
    summaries = {role: Summary(model=EvaluatedModel(spec=role, location=role, kind="local"), model_hash=role,
                               results=summarize(INDEX_TASK, raw(ppl), {}, 1.0))
                 for role, ppl in (("baseline", 20.0), ("pruned", 60.0))}
    assert comparison_rows(summaries)[0] == [] and average_rows([], ["baseline", "pruned"]) == []


def test_the_headline_is_the_first_higher_is_better_share():
    rows = summarize(INDEX_TASK, raw(30.0, acc=0.6), {}, 1.0)
    assert [r.metric for r in rows if r.headline] == ["acc"]  # not the perplexity, not a BLEU of 31
