"""Self-distillation of plain text: prompts cut from a corpus, continued by the target's own greedy
decoding (the embedded tiny target's training data; data/regenerate.py does the same for chat
records)."""

from __future__ import annotations

import json
from pathlib import Path

from specheads.data.regenerate import ReplyMeter, target_fingerprint, load_generation_target, target_continuations
from specheads.data.text import DataError, load_tokenizer
from specheads.heads import atomic

DISTILL_META_SUFFIX = ".meta.json"


def distill_text(target: str, output_path: str, *, texts: list[str] | None = None, num_records: int = 512,
                 prompt_tokens: tuple[int, int] = (8, 48), max_new_tokens: int = 160, batch_size: int = 32,
                 seed: int = 0, dtype: str = "auto", device: str = "cpu", progress: bool = True,
                 log=print) -> Path:
    """Write `num_records` token-id records `{"input_ids": prompt + continuation, "prompt_len": n}`:
    the prompt a random window of `texts` (default: the embedded stdlib corpus, train split), the
    continuation the target's own greedy decoding of it, cut at EOS.

    Why: at decode time the heads see the target's greedy continuations (often repetitive),
    not corpus text; heads trained on exactly that distribution accept far more.
    Reused when OUTPUT.meta.json records the same settings and target; written atomically.
    """
    import random

    from specheads.heads.target.adapter import inference_dtype

    lo, hi = prompt_tokens
    if num_records < 1 or max_new_tokens < 1 or batch_size < 1 or not 1 <= lo <= hi:
        raise DataError(f"distill_text needs num_records, max_new_tokens, batch_size >= 1 and 1 <= min <= max "
                        f"prompt tokens, got {num_records}, {max_new_tokens}, {batch_size}, {prompt_tokens}")
    output = Path(output_path)
    target_id = target_fingerprint(target)
    settings = {"target": target_id, "num_records": num_records, "prompt_tokens": [lo, hi],
                "max_new_tokens": max_new_tokens, "seed": seed, "texts": "stdlib" if texts is None else len(texts),
                "dtype": str(inference_dtype(target, dtype, device)).removeprefix("torch.")}
    meta = output.with_name(output.name + DISTILL_META_SUFFIX)
    if output.exists() and meta.exists() and json.loads(meta.read_text()) == settings:
        log(f"distill: reusing {output} ({num_records} records)")
        return output
    if texts is None:
        from specheads.data.corpus import stdlib_texts

        texts = stdlib_texts("train")
    tokenizer = load_tokenizer(target, False)
    generator = load_generation_target(target, dtype=dtype, device=device)
    rng = random.Random(seed)
    docs = [d for d in (tokenizer(t, add_special_tokens=False)["input_ids"]
                        for t in rng.sample(texts, min(len(texts), 4 * num_records))) if len(d) > hi]
    if not docs:
        raise DataError(f"distill_text: no text is longer than {hi} tokens; give longer texts or a smaller "
                        "prompt_tokens maximum")
    prompts = []
    for _ in range(num_records):
        doc = rng.choice(docs)
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(doc) - length + 1)
        prompts.append(doc[start:start + length])
    meter = ReplyMeter(num_records, "distill: target greedy continuations", progress)
    continuations = target_continuations(generator, tokenizer, prompts, max_new_tokens, batch_size,
                                         on_reply=meter.reply)
    meter.close()
    records = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    lines = "".join(json.dumps({"input_ids": record, "prompt_len": len(prompt)}) + "\n"
                    for record, prompt in zip(records, prompts))
    atomic.write_text(output, lines)
    atomic.write_json(meta, settings)
    num_tokens = sum(len(r) for r in records)
    log(f"distill: wrote {num_records} records, {num_tokens} tokens, to {output}")
    return output
