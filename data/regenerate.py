"""Self-distillation data: rewrite every assistant turn with the target itself.

    specheads data regenerate --target T --input FILE --output FILE [--batch-size N] [--max-new-tokens N]
                              [--thinking default|on|off]

Heads learn to predict the target, so training on the target's own replies (rather than
on another model's) raises acceptance. With --server URL, OpenAI-compatible servers make the
replies instead of a local model (data/remote_replies.py), by the same RecordJob rules, into
the same output and resume file. For each conversation and each assistant turn i,
the target generates a replacement conditioned on the original turns before i, rendered
with the chat template (the tokenizer's, or data/chat.py's fallback) and its generation
prompt. Conditioning on the original turns (not on earlier regenerated replies) makes every
turn independent, so all turns of a conversation are generated together.

Decoding is greedy (deterministic) on the serving engine with continuous batching
(serving/decode/generate.generate_many: up to --batch-size sequences share each target
forward, a finished reply's row takes the next prompt at once, and every record of the run
goes through one such batch, so no row waits for a batch of records to drain), in the
device's fast dtype by default with packed weights (heads/target/cpu_layout.py); a progress bar
shows reply tokens/s and the ETA. Generating with the engine is why data/ imports serving.decode here
(and only here, lazily). Generation stops at the target's EOS ids (its generation_config's,
which for chat models include the end-of-turn token, plus the tokenizer's EOS). A
generation that comes out empty keeps the original reply and is counted. Records that are
not valid chats are skipped and counted by reason (data/records.py); every valid input
record gives exactly one output line, `{"index": i, "messages": [...]}` in OpenAI shape.

Records of user turns only, `{"turns": ["...", ...]}` (MT-bench's shape;
data/chat_prompts.py writes them), become whole conversations: each reply is conditioned on
the target's own earlier replies (multi-turn self-distillation), and a conversation's next
turn is decoded as soon as its previous reply ends, in the same row: its prefill runs only
the new user turn, the conversation so far already being in that row's KV cache (as far as
the re-rendered conversation repeats the generated tokens). On a GPU, new rows and next
turns wait for a group of free rows and are prefilled together, whole, in one forward
(generate_many's prefill_group), and CUDA graphs replay each decode step. A reply
that comes out empty ends its conversation before that turn (counted); a conversation left
without any reply is skipped as "empty reply".

Thinking mode (--thinking, data/chat.py): on or off sets the template's `enable_thinking`
(Qwen3's switch) in every prompt; default leaves the template's own. A reply that thinks
(`<think>R</think>C`) is written as {"role": "assistant", "content": C, "reasoning_content": R}
(reply_message); when it becomes an earlier turn of the next prompt, the template keeps or
strips R as it does at inference (Qwen3 strips the reasoning of replies before the last user
turn), and training renders it the same way (data/chat.py's turn-by-turn sequences).

Resumable: output lines are appended in input order, WRITE_EVERY (64) records at a time (or
--batch-size, if smaller) once every record before them is done, flushed and fsynced; then
OUTPUT.progress.json is replaced atomically with the next input record, the output's byte
length and those records' counts. A rerun truncates the output to that length (dropping a
partial trailing line or a batch written after the last progress update) and continues, so
an interrupted run never duplicates or loses a record. It loses work: its unfinished
records, the finished ones after the first of those, and fewer than WRITE_EVERY before it
are made again. The progress file also records the target the replies come from (and, from
servers, the served model name): a rerun with another target or served name, or another
input, reply length, thinking mode or sampling, is refused in one line, since resuming would
mix two models' replies in one file. Records a server refused (data/remote_replies.py) are
written with the same batch to OUTPUT.rejects.jsonl, one `{"index", "turn", "status",
"reason"}` line each, and truncated with the output on a rerun.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from specheads.data.chat import ensure_chat_template, generation_prompt_ids, reply_message, thinking_kwargs
from specheads.data.records import Conversation, normalize_record
from specheads.data.reply_progress import WRITE_EVERY, InOrderWriter, Progress, start_progress
from specheads.data.text import DataError, load_records, load_tokenizer

REPLY_SLACK_TOKENS = 16  # a decoded reply re-encoded in a later turn's prompt may take this many tokens more


def _stop_ids(target, tokenizer) -> list[int]:
    config = target.model.generation_config
    ids = config.eos_token_id if config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def target_continuations(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                         on_reply=None, follow_up=None, max_prompt_len: int | None = None,
                         temperature: float = 0.0, top_p: float = 1.0,
                         seeds: list[int] | None = None, cuda_graphs: str | None = None,
                         prefill_group: int | None = None) -> list[list[int]]:
    """The target's greedy continuation (token ids, cut before the first stop token) of each
    token-id prompt; at a temperature above 0, a sampled one (top_p; prompt i with seeds[i],
    so that a rerun draws the same). target: a heads/target/adapter.py TargetAdapter
    (load_generation_target). The engine decodes them with continuous batching, batch_size
    sequences per target forward (serving/decode/generate.generate_many); on_reply(num_tokens)
    as each one ends.
    follow_up(index, continuation) may return one more prompt, decoded as soon as a row is
    free (its continuation is appended to the result); max_prompt_len bounds those.
    cuda_graphs: "capture" replays every decode step's forward from a CUDA graph
    (serving/decode/graphs.py; a CUDA target), "eager" runs the same static-shape forward.
    prefill_group: new rows wait for a group this large, prefilled in one forward
    (generate_many; None: its default, grouped on a GPU only)."""
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.generate import SamplingParams, generate_many

    sampling = None
    if temperature > 0:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError(f"sampled continuations need one seed per prompt: got "
                             f"{'none' if seeds is None else len(seeds)} for {len(prompts)} prompts")
        sampling = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed) for seed in seeds]
    stop_ids = _stop_ids(target, tokenizer)

    def cut(result) -> list[int]:
        return result.tokens[:-1] if result.tokens and result.tokens[-1] in stop_ids else result.tokens

    def finished(index, result):
        if on_reply is not None:
            on_reply(len(result.tokens))
        return follow_up(index, cut(result)) if follow_up is not None else None

    graphs = dict(cuda_graphs=cuda_graphs, attn_impl="tree") if cuda_graphs else {}
    results = generate_many(SpeculativeDecoder(target, fallback=None, **graphs), prompts, max_new_tokens, stop_ids,
                            max_batch_size=batch_size, on_result=finished, max_prompt_len=max_prompt_len,
                            sampling=sampling, prefill_group=prefill_group)
    return [cut(result) for result in results]


class ReplyMeter:
    """A progress bar over `total` replies (its ETA) that also shows the reply tokens generated
    per second; `reply(n)` counts one finished reply of n tokens."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="reply", disable=not enabled, leave=True)
        self.start, self.num_tokens = time.perf_counter(), 0

    def reply(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        rate = self.num_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, {self.num_tokens} tokens", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def load_generation_target(target: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                           pack_weights: bool | str = "auto"):
    """The target as the engine generates with it: the device's fast dtype ("auto"), linear
    weights packed where that pays (heads/target/cpu_layout.py; not for CUDA graphs' static shapes:
    pack_weights=False)."""
    from specheads.heads.target.adapter import TargetAdapter

    return TargetAdapter.from_pretrained(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                         pack_weights=pack_weights)


def generate_replies(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     on_reply=None) -> list[str]:
    """Greedy replies (text) to token-id prompts."""
    return [tokenizer.decode(ids, skip_special_tokens=True).strip()
            for ids in target_continuations(target, tokenizer, prompts, max_new_tokens, batch_size, on_reply)]


def _user_turns(record) -> list[str] | None:
    """The user turns of a `{"turns": [...]}` record (see the module doc); None for other shapes."""
    # (datasets' json loader gives every record every key, None where it had none)
    if not isinstance(record, dict) or record.get("turns") is None or record.get("messages") is not None:
        return None
    turns = record["turns"]
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return turns
    return []


class RecordJob:
    """One input record's replies: every assistant turn of a chat record, regenerated from the
    original turns before it (all at once), or a user-turn record's conversation, each reply
    conditioned on the target's own earlier ones (one turn after another). `prompt_of(messages)`
    makes the prompt of the reply after `messages` (token ids here, chat messages for a server:
    data/remote_replies.py); `took_reply` takes that reply as an assistant message. `counts` is
    what the record adds to the progress, applied when its line is written."""

    def __init__(self, index: int, record, prompt_of):
        self.index, self.prompt_of = index, prompt_of
        self.counts: Counter = Counter()
        self.line: str | None = None  # the output line once done (None: skipped)
        self.turns = _user_turns(record)
        self.skip_reason: str | None = None
        self.rejection: dict | None = None  # why a server refused this record (refuse)
        self.first_prompts: list[tuple[int, object]] = []  # (turn, prompt) to generate first
        if self.turns is not None:
            if not self.turns:
                self.skip_reason = "'turns' is not a non-empty list of non-empty strings"
                return
            self.messages = [{"role": "user", "content": self.turns[0]}]
            self.first_prompts = [(0, prompt_of(self.messages))]
            return
        document, reason = normalize_record(record)
        if not isinstance(document, Conversation):
            self.skip_reason = reason or "not a chat record"
            return
        self.messages = [dict(m) for m in document.to_list()]
        self.first_prompts = [(turn, prompt_of(self.messages[:turn]))
                              for turn, m in enumerate(self.messages) if m["role"] == "assistant"]
        self.num_waiting = len(self.first_prompts)  # >= 1: normalize_record refuses chats without a reply

    def took_reply(self, turn: int, message: dict):
        """The reply to `turn` came in, as an assistant message (reasoning apart) -> the next
        (turn, prompt) to generate, or None; sets `line` once the record is done."""
        reply = message["content"]
        self.counts["num_turns"] += 1
        if self.turns is None:  # a chat record: every turn was asked at once
            if reply:
                self.messages[turn] = message
            else:
                self.counts["num_empty_kept"] += 1
            self.num_waiting -= 1
            if not self.num_waiting:
                self._finish()
            return None
        if not reply:
            self.messages.pop()
            self.counts["num_empty_ended"] += 1
        else:
            self.messages.append(message)
            if len(self.messages) // 2 < len(self.turns):
                self.messages.append({"role": "user", "content": self.turns[len(self.messages) // 2]})
                return turn + 1, self.prompt_of(self.messages)
        if self.messages:
            self._finish()
        else:
            self.skip_reason = "empty reply"
        return None

    def refuse(self, reason: str, rejection: dict | None = None) -> None:
        """No reply can be made for this record (a server refused its request): it is skipped and
        counted under `reason`; replies still to come for it are ignored. `rejection` (the
        request's turn, HTTP status and the server's message) goes to the rejects file."""
        self.line, self.skip_reason = None, reason
        self.rejection = rejection

    def _finish(self) -> None:
        self.line = json.dumps({"index": self.index, "messages": self.messages}, ensure_ascii=False) + "\n"

    @property
    def max_replies(self) -> int:
        """How many replies this record asks for at most (0: skipped)."""
        return len(self.turns) if self.turns is not None else len(self.first_prompts)

    @property
    def done(self) -> bool:
        return self.line is not None or self.skip_reason is not None


class _Job(RecordJob):
    """A RecordJob whose prompts are token ids of the local chat template and whose replies
    come in as generated token ids."""

    def __init__(self, index: int, record, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        super().__init__(index, record, lambda messages: generation_prompt_ids(tokenizer, messages, template_kwargs))

    def replied(self, turn: int, tokens: list[int]) -> tuple[int, list[int]] | None:
        return self.took_reply(turn, reply_message(self.tokenizer, tokens))  # its reasoning apart, if it thought

    def longest_prompt(self, max_new_tokens: int) -> int:
        """The longest prompt this record can make: for a conversation every user turn, and
        every earlier reply at its longest (re-encoded text can take a few tokens more than it
        was generated in)."""
        if self.turns is None:
            return max((len(prompt) for _, prompt in self.first_prompts), default=0)
        rendered = [m for turn in self.turns for m in ({"role": "user", "content": turn},
                                                        {"role": "assistant", "content": ""})][:-1]
        return len(generation_prompt_ids(self.tokenizer, rendered, self.template_kwargs)) \
            + (len(self.turns) - 1) * (max_new_tokens + REPLY_SLACK_TOKENS)


def regenerate(target: str, input_path: str, output_path: str, *, tokenizer_path: str | None = None,
               batch_size: int = 96, max_new_tokens: int = 256, dtype: str = "auto", device: str = "cpu",
               trust_remote_code: bool = False, max_batches: int | None = None, log=print,
               progress_bar: bool = True, cuda_graphs: str | None = None,
               prefill_group: int | None = None, thinking: str = "default") -> Progress:
    """Regenerate `input_path` into `output_path`, resuming a previous run; -> the progress so far.

    The replies are decoded by the engine with up to batch_size sequences per forward, in
    `dtype` ("auto": the device's fast dtype), every record in one continuous batch (a row
    never waits for a batch of records to drain); lines are written min(batch_size,
    WRITE_EVERY) records at a time. max_batches stops after that many batches of batch_size
    records (a later call continues).
    cuda_graphs, prefill_group: as in target_continuations. thinking: the template's thinking
    mode (module doc).
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise DataError(f"batch size and max new tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    records = load_records(input_path)
    output = Path(output_path)
    tokenizer = load_tokenizer(tokenizer_path or target, trust_remote_code)
    ensure_chat_template(tokenizer)
    template_kwargs = thinking_kwargs(tokenizer, thinking)  # refused before anything is written
    progress = start_progress(input_path, output, len(records), max_new_tokens, thinking,
                              target=str(Path(target).resolve()) if Path(target).exists() else str(target))
    if progress.next_record >= len(records):
        log(f"regenerate: {output} is complete: {progress.summary()}")
        return progress
    if progress.next_record:
        log(f"regenerate: resuming at record {progress.next_record}")
    generator = load_generation_target(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                       pack_weights=False if cuda_graphs else "auto")
    stop = len(records) if max_batches is None else min(len(records), progress.next_record + max_batches * batch_size)
    jobs = [_Job(index, records[index], tokenizer, template_kwargs) for index in range(progress.next_record, stop)]
    to_come = sum(job.max_replies for job in jobs)  # at most
    meter = ReplyMeter(progress.num_turns + to_come, "regenerate: the target's replies", progress_bar,
                       initial=progress.num_turns)
    writer = InOrderWriter(output, progress, min(batch_size, WRITE_EVERY))
    slots = [(job, turn) for job in jobs for turn, _ in job.first_prompts]  # prompt k -> (its job, turn)

    def replied(index: int, tokens: list[int]) -> list[int] | None:
        job, turn = slots[index]
        follow_up = job.replied(turn, tokens)
        if follow_up is not None:
            slots.append((job, follow_up[0]))
            return follow_up[1]
        if job.done:
            writer.finished(job)
        return None

    for job in jobs:
        if job.done:  # skipped before any reply
            writer.finished(job)
    prompts = [prompt for job in jobs for _, prompt in job.first_prompts]
    if prompts:
        longest = max(job.longest_prompt(max_new_tokens) for job in jobs if not job.done)
        target_continuations(generator, tokenizer, prompts, max_new_tokens, batch_size, meter.reply,
                             follow_up=replied, max_prompt_len=longest, cuda_graphs=cuda_graphs,
                             prefill_group=prefill_group)
    writer.close()
    meter.close()
    log(f"regenerate: {progress.summary()}")
    return progress


def target_fingerprint(target: str) -> str:
    """Path plus the weights' size and mtime: a rebuilt target invalidates distilled data."""
    weights = Path(target) / "model.safetensors"
    if weights.exists():
        stat = weights.stat()
        return f"{Path(target).resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    return str(target)

