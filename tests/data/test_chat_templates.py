"""Real chat templates (tests/data/templates: Llama 3.1/3.2, Qwen2.5, Qwen3, Mistral Nemo,
Gemma 2/3, Phi-3.5, SmolLM2): the assistant-only loss mask of every reply, one sequence where
the template renders prefixes stably and turn by turn where it rewrites earlier turns (Qwen3,
Mistral with a system message), Qwen3's thinking mode, and regeneration's reasoning.

Each template gets a tiny byte-level BPE (vocab < 512) with its model's special tokens, saved
and loaded through `from_pretrained`. What a reply must look like is written out here per
template (its end-of-turn marker); the prompt before it is the template's own generation
prompt, as `apply_chat_template(..., add_generation_prompt=True)` renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specheads.data.chat import reply_message, thinking_kwargs, tokenize_conversation
from specheads.data.records import Conversation, normalize_record
from specheads.data.text import DataError, build_blocks

TEMPLATES = Path(__file__).parent / "templates"
LLAMA3 = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
          "<|python_tag|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]"]
GEMMA = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
PHI3 = ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

SYSTEM = {"role": "system", "content": "You are terse."}
TWO_ROUNDS = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
              {"role": "user", "content": "And three plus three?"}, {"role": "assistant", "content": "Six, of course."}]
EMPTY_THINK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Case:
    template: str  # file in tests/data/templates
    specials: list[str]
    bos: str | None
    eos: str
    reply_end: str  # what the template writes after a reply: its end-of-turn marker
    system: bool = True  # the conversation starts with a system message
    one_sequence: bool = True  # prefix-stable: the whole conversation is one training sequence
    thinking: str = "default"
    reply_start: str = ""  # what the model writes before the reply's content (Qwen3: its think block)
    added: list[str] = field(default_factory=list)  # added tokens that are not special (Qwen3's <think>)

    def reply(self, content: str) -> str:
        return self.reply_start + content + self.reply_end


QWEN3 = dict(template="Qwen-Qwen3-0.6B.jinja", specials=CHATML, bos=None, eos="<|im_end|>", reply_end="<|im_end|>\n",
             one_sequence=False, added=["<think>", "</think>"])
CASES = {
    "llama-3.1": Case("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
                      "<|eot_id|>"),
    "llama-3.2": Case("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
                      "<|eot_id|>"),
    "qwen2.5": Case("Qwen-Qwen2.5-7B-Instruct.jinja", CHATML, None, "<|im_end|>", "<|im_end|>\n"),
    # Qwen3 renders a reply before the last user turn without its think block: turn by turn.
    "qwen3": Case(**QWEN3, reply_start=EMPTY_THINK),
    "qwen3-thinking-on": Case(**QWEN3, thinking="on", reply_start=EMPTY_THINK),
    "qwen3-thinking-off": Case(**QWEN3, thinking="off"),  # the empty think block is the prompt's
    # Mistral puts the system message before the last user turn only.
    "mistral": Case("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL, "<s>", "</s>", "</s>", one_sequence=False),
    "mistral-no-system": Case("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL, "<s>", "</s>", "</s>",
                              system=False),
    "gemma-2": Case("google-gemma-2-2b-it.jinja", GEMMA, "<bos>", "<eos>", "<end_of_turn>\n", system=False),
    "gemma-3": Case("google-gemma-3-it.jinja", GEMMA, "<bos>", "<eos>", "<end_of_turn>\n"),
    # Phi-3 ends the conversation with EOS, after the last reply's <|end|>: not part of the reply.
    "phi-3.5": Case("microsoft-Phi-3.5-mini-instruct.jinja", PHI3, "<s>", "<|endoftext|>", "<|end|>\n"),
    "smollm2": Case("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", CHATML, None, "<|im_end|>", "<|im_end|>\n"),
}


def build_tokenizer(directory: Path, case: Case):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=case.specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([m["content"] for m in [SYSTEM, *TWO_ROUNDS]] * 10, trainer=trainer)
    others = [token for token in case.specials if token not in (case.bos, case.eos)]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=case.bos, eos_token=case.eos,
                                        additional_special_tokens=others, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(case.added)
    tokenizer.chat_template = (TEMPLATES / case.template).read_text()
    tokenizer.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    assert loaded.chat_template == tokenizer.chat_template and len(loaded) <= 512
    return loaded


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    built = {}

    def get(name: str):
        case = CASES[name]
        if case.template not in built:
            built[case.template] = build_tokenizer(tmp_path_factory.mktemp(case.template.removesuffix(".jinja")), case)
        return built[case.template]
    return get


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def masked_runs(tokenizer, ids: list[int], mask: list[bool]) -> list[tuple[int, str]]:
    """-> (start token, text) of each run of tokens with loss."""
    runs, start = [], None
    for k, on in enumerate([*mask, False]):
        if on and start is None:
            start = k
        elif not on and start is not None:
            runs.append((start, decode(tokenizer, ids[start:k])))
            start = None
    return runs


def generation_prompt(tokenizer, messages: list[dict], thinking: str) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **thinking_kwargs(tokenizer, thinking))


def conversation(messages: list[dict]) -> Conversation:
    document, reason = normalize_record({"messages": messages})
    assert reason is None, reason
    return document


@pytest.mark.parametrize("name", list(CASES))
def test_every_reply_has_loss_on_exactly_what_the_model_writes_after_its_prompt(name, tokenizers):
    """Per template: each reply's loss covers the reply and its end-of-turn marker, nothing else,
    and what comes before it is the prompt the model is given at inference for that turn."""
    case, tokenizer = CASES[name], tokenizers(name)
    messages = ([SYSTEM] if case.system else []) + TWO_ROUNDS
    chat = tokenize_conversation(tokenizer, conversation(messages), thinking_kwargs(tokenizer, case.thinking))
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    expected = [case.reply(messages[i]["content"]) for i in replies]
    assert chat.turn_by_turn is not case.one_sequence and chat.num_reasoning_left_out == 0
    if case.one_sequence:
        (ids, mask), = chat.sequences
        assert decode(tokenizer, ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        runs = masked_runs(tokenizer, ids, mask)
        assert [text for _, text in runs] == expected
        for (start, _), i in zip(runs, replies):
            assert decode(tokenizer, ids[:start]) == generation_prompt(tokenizer, messages[:i], case.thinking)
        return
    assert len(chat.sequences) == len(replies)
    for (ids, mask), i, reply in zip(chat.sequences, replies, expected):
        (start, text), = masked_runs(tokenizer, ids, mask)
        assert text == reply and decode(tokenizer, ids[start:]) == reply  # the sequence ends with the reply
        assert decode(tokenizer, ids[:start]) == generation_prompt(tokenizer, messages[:i], case.thinking)


def test_a_records_reasoning_content_is_kept_on_assistant_turns_only():
    reply = {"role": "assistant", "content": "Four."}
    for reasoning, kept in [("Two and two.", {"reasoning_content": "Two and two."}), ("", {}), (None, {})]:
        document, _ = normalize_record({"messages": [TWO_ROUNDS[0], {**reply, "reasoning_content": reasoning}]})
        assert document.messages[1] == {**reply, **kept}
    assert normalize_record({"messages": [TWO_ROUNDS[0], {**reply, "reasoning_content": 3}]}) == (
        None, "'messages' turn 'reasoning_content' is not a string")
    assert normalize_record({"messages": [{**TWO_ROUNDS[0], "reasoning_content": "x"}, reply]}) == (
        None, "'messages' has 'reasoning_content' on a user turn")


def qwen3_with_reasoning() -> list[dict]:
    first, second = TWO_ROUNDS[1], TWO_ROUNDS[3]
    return [SYSTEM, TWO_ROUNDS[0], {**first, "reasoning_content": "Two and two make four."}, TWO_ROUNDS[2],
            {**second, "content": "<think>\nThree doubled.\n</think>\n\n" + second["content"]}]


def test_qwen3_trains_each_reply_with_its_reasoning_and_later_turns_without_it(tokenizers):
    """Reasoning as `reasoning_content` or as a <think> block in the content: each reply is
    trained with its own reasoning, and the next turn's prompt leaves it out, as Qwen3's
    template does at inference."""
    tokenizer, messages = tokenizers("qwen3"), qwen3_with_reasoning()
    chat = tokenize_conversation(tokenizer, conversation(messages))
    assert chat.turn_by_turn and chat.num_reasoning_left_out == 0
    (first_ids, first_mask), (second_ids, second_mask) = chat.sequences
    assert [text for _, text in masked_runs(tokenizer, first_ids, first_mask)] == [
        "<think>\nTwo and two make four.\n</think>\n\nFour.<|im_end|>\n"]
    (start, text), = masked_runs(tokenizer, second_ids, second_mask)
    assert text == "<think>\nThree doubled.\n</think>\n\nSix, of course.<|im_end|>\n"
    prompt = decode(tokenizer, second_ids[:start])
    assert prompt == generation_prompt(tokenizer, messages[:4], "default")
    assert "Two and two" not in prompt and "<|im_start|>assistant\nFour.<|im_end|>" in prompt


def test_thinking_off_leaves_reasoning_out_and_counts_it(tokenizers):
    tokenizer = tokenizers("qwen3")
    chat = tokenize_conversation(tokenizer, conversation(qwen3_with_reasoning()), thinking_kwargs(tokenizer, "off"))
    assert chat.num_reasoning_left_out == 2
    assert [text for ids, mask in chat.sequences for _, text in masked_runs(tokenizer, ids, mask)] == [
        "Four.<|im_end|>\n", "Six, of course.<|im_end|>\n"]
    blocks = build_blocks("mem", [{"messages": qwen3_with_reasoning()}], "text", 256, None, tokenizer=tokenizer,
                          thinking="off")
    assert blocks.report.num_reasoning_left_out == 2
    assert "reasoning of 2 replies not trained on" in blocks.report.summary()


def test_reasoning_a_template_does_not_render_is_counted(tokenizers):
    tokenizer = tokenizers("llama-3.1")
    chat = tokenize_conversation(tokenizer, conversation(qwen3_with_reasoning()))
    # Llama 3 renders the <think> block written in the content, not reasoning_content.
    assert not chat.turn_by_turn and chat.num_reasoning_left_out == 1
    (ids, mask), = chat.sequences
    assert [text for _, text in masked_runs(tokenizer, ids, mask)] == [
        "Four.<|eot_id|>", "<think>\nThree doubled.\n</think>\n\nSix, of course.<|eot_id|>"]


def test_thinking_needs_a_template_with_the_switch(tokenizers):
    assert thinking_kwargs(tokenizers("qwen3"), "on") == {"enable_thinking": True}
    assert thinking_kwargs(tokenizers("qwen3"), "default") == {}
    with pytest.raises(ValueError, match="has no enable_thinking switch"):
        thinking_kwargs(tokenizers("llama-3.2"), "off")
    with pytest.raises(DataError, match="thinking 'on': the chat template .* has no enable_thinking switch"):
        build_blocks("mem", [{"messages": TWO_ROUNDS}], "text", 64, None, tokenizer=tokenizers("gemma-3"),
                     thinking="on")


def test_turn_by_turn_conversations_are_reported_and_trained_reply_by_reply(tokenizers):
    tokenizer = tokenizers("qwen3")
    records = [{"messages": [SYSTEM, *TWO_ROUNDS]}, {"messages": TWO_ROUNDS[:2]}, {"messages": qwen3_with_reasoning()}]
    blocks = build_blocks("mem", records, "text", 512, None, tokenizer=tokenizer)
    report = blocks.report
    assert (report.num_documents, report.num_conversations, report.num_turn_by_turn, report.num_turn_sequences) == (
        3, 3, 2, 4)
    assert "2 of them rendered turn by turn, as 4 sequences" in report.summary() and not report.skipped
    # Five sequences (one per reply) joined by EOS, with loss on the five replies.
    stream = decode(tokenizer, blocks.input_ids.flatten().tolist())
    assert stream.count("<|im_start|>user\nWhat is two plus two?") == 5
    masked = decode(tokenizer, blocks.input_ids.flatten()[blocks.loss_mask.flatten()].tolist())
    assert masked.count("<|im_end|>") == 5 and masked.count("Two and two make four.") == 1


def test_a_turn_longer_than_seq_len_is_left_out_and_counted_while_its_conversation_trains(tokenizers):
    tokenizer = tokenizers("qwen3")
    (first, _), (second, _) = tokenize_conversation(tokenizer, conversation([SYSTEM, *TWO_ROUNDS])).sequences
    seq_len = len(first) + 2
    assert len(second) > seq_len
    blocks = build_blocks("mem", [{"messages": [SYSTEM, *TWO_ROUNDS]}], "text", seq_len, None, tokenizer=tokenizer,
                          truncate=False)
    assert blocks.report.skipped_turns == {"longer than seq_len": 1} and blocks.report.num_turn_sequences == 1
    assert "1 replies left out (longer than seq_len: 1)" in blocks.report.summary()
    with pytest.raises(DataError, match="longer than seq_len: 1"):  # no reply fits: the record is skipped
        build_blocks("mem", [{"messages": [SYSTEM, *TWO_ROUNDS]}], "text", 8, None, tokenizer=tokenizer, truncate=False)


# ---------------------------------------------------------------------------- regeneration

def qwen3_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("special", [False, True], ids=["think-tokens-plain", "think-tokens-special"])
def test_a_generated_reply_keeps_its_reasoning_apart(tmp_path, special):
    """`</think>` splits a reply's reasoning off, whether the tokenizer counts the think tokens
    special (dropped when decoding) or not (Qwen3's)."""
    case = CASES["qwen3"]
    case = Case(**{**case.__dict__, "specials": case.specials + (case.added if special else []),
                   "added": [] if special else case.added})
    tokenizer = build_tokenizer(tmp_path, case)
    assert ("<think>" in tokenizer.all_special_tokens) is special
    tokens = qwen3_tokens(tokenizer, "<think>\nTwo and two.\n</think>\n\nFour.")
    assert reply_message(tokenizer, tokens) == {"role": "assistant", "content": "Four.",
                                                "reasoning_content": "Two and two."}
    assert reply_message(tokenizer, qwen3_tokens(tokenizer, "Four.")) == {"role": "assistant", "content": "Four."}


@pytest.mark.parametrize("template, strips", [("qwen3", True), ("keeps", False)])
def test_regeneration_keeps_or_strips_an_earlier_replys_reasoning_as_the_template_does(template, strips, tokenizers):
    """A user-turn record: the reply to turn 1 thinks; the prompt of turn 2 has its reasoning
    or not as the template renders it (Qwen3 strips it; a template that renders
    reasoning_content keeps it), and the written record keeps it for training."""
    from transformers import AutoTokenizer

    from specheads.data.regenerate import _Job

    tokenizer = AutoTokenizer.from_pretrained(tokenizers("qwen3").name_or_path)
    if template == "keeps":
        tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}"
                                   "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    job = _Job(0, {"turns": ["What is two plus two?", "And three plus three?"]}, tokenizer)
    (turn, prompt), = job.first_prompts
    assert decode(tokenizer, prompt).endswith("What is two plus two?<|im_end|>\n<|im_start|>assistant\n")
    turn, prompt = job.replied(turn, qwen3_tokens(tokenizer, "<think>\nTwo and two.\n</think>\n\nFour."))
    text = decode(tokenizer, prompt)
    assert "Four." in text and ("Two and two." not in text) is strips
    assert job.replied(turn, qwen3_tokens(tokenizer, "Six.")) is None
    written = json.loads(job.line)["messages"]
    assert written[1] == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    assert written[3] == {"role": "assistant", "content": "Six."}


def test_regeneration_with_thinking_off_prompts_with_the_empty_think_block(tokenizers):
    from specheads.data.regenerate import _Job

    tokenizer = tokenizers("qwen3")
    job = _Job(0, {"messages": [SYSTEM, *TWO_ROUNDS]}, tokenizer, thinking_kwargs(tokenizer, "off"))
    assert [turn for turn, _ in job.first_prompts] == [2, 4]
    assert all(decode(tokenizer, prompt).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
               for _, prompt in job.first_prompts)


def test_regenerate_refuses_a_thinking_mode_before_writing_anything(tokenizers, tmp_path, capsys):
    import argparse

    from specheads import data_cli

    parser = argparse.ArgumentParser(prog="specheads")
    data_cli.add_parser(parser.add_subparsers(dest="command"))
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    output = tmp_path / "out.jsonl"
    (tmp_path / "no-model").mkdir()  # a target that passes the name checks and never loads
    (tmp_path / "no-model" / "config.json").write_text("{}")
    argv = ["data", "regenerate", "--target", str(tmp_path / "no-model"), "--input", str(source), "--output",
            str(output), "--tokenizer", tokenizers("smollm2").name_or_path]
    assert data_cli.run(parser.parse_args(argv + ["--thinking", "on"])) == 2
    assert "has no enable_thinking switch" in capsys.readouterr().err and not output.exists()
    assert data_cli.run(parser.parse_args(argv + ["--thinking", "yes"])) == 2
    assert "thinking: expected one of default, on, off, got 'yes'" in capsys.readouterr().err


def test_regenerate_records_its_thinking_mode_and_resumes_only_in_it(tokenizers, tmp_path):
    from conftest import make_tiny_model

    from specheads.data.regenerate import regenerate
    from specheads.data.reply_progress import progress_path

    target = make_tiny_model("llama", tmp_path / "target", vocab_size=512, hidden_size=32)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"turns": ["What is two plus two?", "And three plus three?"]}) + "\n")
    output = tmp_path / "out.jsonl"
    run = dict(tokenizer_path=tokenizers("qwen3").name_or_path, batch_size=2, max_new_tokens=3, dtype="float32",
               log=lambda _: None, progress_bar=False)
    progress = regenerate(str(target), str(source), str(output), thinking="off", **run)
    assert progress.num_written == 1 and json.loads(progress_path(output).read_text())["thinking"] == "off"
    with pytest.raises(DataError, match="belongs to another run .* thinking 'off'"):
        regenerate(str(target), str(source), str(output), thinking="on", **run)
