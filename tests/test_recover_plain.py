"""generate.chat_template false: the teacher continues the plain prompt up to the stop, and every method trains on
plain prompt + answer + stop, the text the probe evaluation scores; true leaves the chat format as it was."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.recover import heldout, kd, selfgen, train
from layerprune.recover.schema import GenerationSection, RecoverRecipe

PROMPT = "3 + 4 = 7\n12 + 7 ="
ROWS = [{"id": "a", "prompt": PROMPT, "response": " 19", "tokens": 3}]
PLAIN = GenerationSection(chat_template=False)
CHAT = GenerationSection()
TEMPLATE_MARKS = ("<|", "<s>", "</s>", "<pad>")


def _recipe(chat: bool) -> RecoverRecipe:
    return RecoverRecipe.model_validate({"lora": {"r": 4}, "generate": {"chat_template": chat, "max_new_tokens": 16},
                                         "train": {"max_steps": 1, "batch_size": 1, "gradient_checkpointing": False,
                                                   "max_length": 64}})


def _sft_example(model_dir: Path, chat: bool) -> tuple[str, str]:
    """The first training example as TRL's SFTTrainer prepared it: the whole text and the part with a loss."""
    recipe = _recipe(chat)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = train.sft_config(recipe, Path("/tmp/unused-plain"), torch.device("cpu"), "adamw_torch", 0, has_eval=False)
    trainer = train.make_trainer(recipe, AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, args,
                                 train.to_dataset(ROWS, recipe.generate, tokenizer, 64), None)
    example = trainer.train_dataset[0]
    labels = example.get("labels")
    if labels is None:
        labels = [t if m else -100 for t, m in zip(example["input_ids"], example["completion_mask"], strict=True)]
    return tokenizer.decode(example["input_ids"]), tokenizer.decode([t for t in labels if t != -100])


def test_plain_sft_trains_on_prompt_plus_answer_without_template_tokens(tiny_llama):
    text, target = _sft_example(tiny_llama, chat=False)
    assert text == PROMPT + " 19\n" and target == " 19\n"  # no end-of-sequence or template token appended
    chat_text, chat_target = _sft_example(tiny_llama, chat=True)
    assert "<|user|>" in chat_text and "<|assistant|>" in chat_text and PROMPT in chat_text  # true: unchanged
    assert chat_target.startswith((" 19", "19"))


def test_plain_distillation_data_is_the_same_text(tiny_llama):
    from trl.experimental.utils import DataCollatorForChatML

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    dataset = kd.messages_dataset(ROWS, PLAIN, tokenizer, 64)
    batch = DataCollatorForChatML(tokenizer=tokenizer, max_length=64)(list(dataset))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert tokenizer.decode(ids[batch["attention_mask"][0] == 1]) == PROMPT + " 19\n"
    assert tokenizer.decode(labels[labels != -100]) == " 19\n"
    assert tokenizer.decode(batch["prompts"][0][batch["prompt_attention_mask"][0] == 1]) == PROMPT
    assert list(kd.prompts_dataset([PROMPT], PLAIN)) == [{"prompt": PROMPT}]
    assert kd.prompts_dataset([PROMPT], CHAT)[0]["prompt"][-1] == {"role": "user", "content": PROMPT}
    chat = kd.messages_dataset(ROWS, CHAT, tokenizer, 64)[0]["messages"]
    assert chat[-1] == {"role": "assistant", "content": " 19"} and chat[0]["role"] == "system"
    (held_ids, start), = heldout.encode_rows(tokenizer, ROWS, PLAIN, 64)
    assert tokenizer.decode(held_ids) == PROMPT + " 19\n" and tokenizer.decode(held_ids[start:]) == " 19\n"
    (chat_ids, _), = heldout.encode_rows(tokenizer, ROWS, CHAT, 64)
    assert "<|assistant|>" in tokenizer.decode(chat_ids)


def test_plain_teacher_answer_is_the_greedy_continuation_cut_at_the_stop(tiny_llama, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    settings = GenerationSection(chat_template=False, temperature=0, max_new_tokens=12, stop=" ", batch_size=1)
    prompts = [selfgen.Prompt(selfgen.prompt_id(t), t) for t in (PROMPT, "Question: what is 12 + 7? Answer:")]
    selfgen.generate_responses(model, tokenizer, prompts, settings, tmp_path / "r.jsonl")
    rows = selfgen.responses_for(prompts, tmp_path / "r.jsonl")
    for prompt, row in zip(prompts, rows, strict=True):
        enc = tokenizer(prompt.text, return_tensors="pt")  # the evaluation's encoding: no template, default specials
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        full = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert row["response"] == full.partition(" ")[0] and " " not in row["response"]
        if " " in full:
            assert not row["truncated"]


def test_plain_record_keeps_the_leading_space_and_marks_a_missing_stop(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = selfgen.Prompt("a", PROMPT)
    ids = tokenizer(" 19\n5 + 1 =", add_special_tokens=False)["input_ids"]
    stopped = selfgen._record(prompt, tokenizer, ids, PLAIN)
    assert stopped["response"] == " 19" and not stopped["truncated"]
    long = tokenizer(" 19 + 19", add_special_tokens=False)["input_ids"]
    cut = selfgen._record(prompt, tokenizer, long, GenerationSection(chat_template=False, max_new_tokens=len(long)))
    assert cut["truncated"] and cut["response"] == " 19 + 19"
    assert selfgen._record(prompt, tokenizer, ids, CHAT)["response"] == "19\n5 + 1 ="  # chat: stripped, as before


def test_plain_on_policy_samples_end_at_the_stop(tiny_llama, tiny_models, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    recipe = RecoverRecipe.model_validate({"method": "opd", "generate": {"chat_template": False},
                                           "opd": {"max_new_tokens": 8}, "train": {"max_steps": 1, "batch_size": 1}})
    common = train.training_arguments(recipe, tmp_path / "t", torch.device("cpu"), "adamw_torch", 0)
    model, teacher = (AutoModelForCausalLM.from_pretrained(tiny_llama) for _ in range(2))
    trainer = kd.opd_trainer(recipe, model, teacher, tokenizer, common, [PROMPT], None, [])
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert set(newline) <= set(trainer.eos_token_ids) and tokenizer.eos_token_id in trainer.eos_token_ids
    assert trainer.generation_config.eos_token_id == trainer.eos_token_ids
    chat = kd.opd_trainer(_recipe(True).model_copy(update={"opd": recipe.opd}), AutoModelForCausalLM.from_pretrained(
        tiny_llama), teacher, tokenizer, common, [PROMPT], None, [])
    assert not set(newline) & set(chat.eos_token_ids)


def test_a_row_with_one_completion_token_is_held_out_as_sft_and_kd_train_on_it(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = [{"id": "e", "prompt": PROMPT, "response": "", "tokens": 1}]  # the answer is its stop alone
    (ids, start), = heldout.encode_rows(tokenizer, rows, PLAIN, 64)
    assert tokenizer.decode(ids[start:]) == "\n" and start == len(ids) - 1
    assert len(kd.messages_dataset(rows, PLAIN, tokenizer, 64)) == 1
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert heldout.held_out_metrics(model, model, [(ids, start)])["tokens"] == 1
    assert heldout.encode_rows(tokenizer, rows, PLAIN, start) == []  # cut before its completion: nothing to score
