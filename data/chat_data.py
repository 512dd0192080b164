"""The `embedded:chat` data set of a target: the chat prompts (data/chat_prompts.py, with a share
written by the target itself: data/self_instruct.py) and the target's own replies to them
(data/regenerate.py), made once, cached and reused.

It sits above the prompt builders and the regeneration step, so that neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specheads.data.chat_prompts import CHAT_DATA_VERSION, EMBEDDED_CHAT, write_prompts, write_records


def self_distilled_chat(target_path: str, num_prompts: int, max_new_tokens: int, *, batch_size: int | None = None,
                        seed: int = 0, dtype: str = "auto", self_instruct_fraction: float = 0.0,
                        self_instruct_temperature: float = 0.0, cache_dir: str | Path | None = None,
                        device: str = "cpu", thinking: str = "default", log=print) -> Path:
    """The `embedded:chat` data of a target: `num_prompts` prompts (build_prompts; with
    self_instruct_fraction > 0 up to that share written by the target itself, greedily or
    sampled at self_instruct_temperature: data/self_instruct.py) with the target's own greedy
    replies (data/regenerate.py, in `dtype`: "auto" is the device's fast dtype), as
    OpenAI-messages JSON lines in the specheads cache;
    generated on first use, resumed if interrupted, then reused.
    On a CUDA device the replies decode from CUDA graphs, 512 sequences per forward (default
    batch_size; 96 on a CPU): on an H200 that made SmolLM2's replies at about 12,500 tok/s.
    thinking: the chat template's thinking mode the replies are generated in (data/chat.py)."""
    from specheads.data.regenerate import target_fingerprint, regenerate
    from specheads.data.tiny_target import default_cache_dir
    from specheads.heads import atomic
    from specheads.heads.target.adapter import inference_dtype
    from filelock import FileLock

    resolved = str(inference_dtype(target_path, dtype, device)).removeprefix("torch.")  # as the replies run
    on_gpu = device.startswith("cuda")
    batch_size = batch_size or (512 if on_gpu else 96)
    settings = {"version": CHAT_DATA_VERSION, "target": target_fingerprint(target_path), "num": num_prompts,
                "max_new_tokens": max_new_tokens, "seed": seed, "dtype": resolved,
                "self_instruct_fraction": self_instruct_fraction,
                "self_instruct_temperature": self_instruct_temperature}
    if thinking != "default":  # keyed only when set, so that data cached before the option stays valid
        settings["thinking"] = thinking
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(cache_dir or default_cache_dir()) / "chat" / f"{Path(target_path).name}-{key}"
    replies, done = directory / "replies.jsonl", directory / "done.json"
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory.with_name(directory.name + ".lock")):
        if not done.exists():
            prompts = directory / "prompts.jsonl"
            if not prompts.exists() and self_instruct_fraction > 0:
                from specheads.data.self_instruct import mixed_prompts

                records, _ = mixed_prompts(num_prompts, target_path, self_instruct_fraction=self_instruct_fraction,
                                           seed=seed, temperature=self_instruct_temperature,
                                           batch_size=batch_size, dtype=resolved, device=device, log=log)
                write_records(prompts, records)
            elif not prompts.exists():
                write_prompts(prompts, num_prompts, seed=seed)
            log(f"{EMBEDDED_CHAT}: the target replies to {num_prompts} prompts (once; cached in {directory})")
            progress = regenerate(target_path, str(prompts), str(replies), batch_size=batch_size,
                                  max_new_tokens=max_new_tokens, dtype=resolved, device=device,
                                  cuda_graphs="capture" if on_gpu else None, log=log, thinking=thinking)
            atomic.write_json(done, {**settings, "summary": progress.summary()})
    return replies
