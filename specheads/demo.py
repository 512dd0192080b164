"""`specheads demo`: the whole product end to end on the embedded tiny target.

1. build (or reuse) the embedded target: a small Llama trained on the stdlib sources;
2. train Medusa heads on it with DeepSpeed (the shipped tiny-medusa recipe);
3. decode the same prompts with HF generate, the engine without heads and the engine
   with heads, check the outputs are identical, and print alpha, tau and the speedup.
"""

from __future__ import annotations

import shutil
import sys
import time
from importlib import resources
from pathlib import Path

DEMO_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Reader:\n    def __init__(self, path):\n        self.path = path\n\n    def read(self",
    "    def __repr__(self):\n        return ",
    "def _check_arg(name, value):\n    if not isinstance(value, int):\n        raise TypeError(",
    "        for key, value in sorted(self.items()):\n            ",
    "try:\n    import _thread\nexcept ImportError:\n",
    "    @property\n    def name(self):\n        \"\"\"Return the name",
    "def join(a, *p):\n    \"\"\"Join two or more pathname components",
]


def default_recipe() -> Path:
    return Path(str(resources.files("specheads.recipes") / "tiny-medusa.yaml"))


def _step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def build_target() -> str:
    from specheads.data.tiny_target import read_build_info, resolve_target

    path = resolve_target("embedded:tiny", progress=True)
    info = read_build_info(path)
    print(f"target: {path}\n  {info.get('num_parameters', 0) / 1e6:.2f}M parameters, vocab "
          f"{info.get('vocab_size')}, held-out loss {info.get('heldout_loss', float('nan')):.3f} nats "
          f"(unigram baseline {info.get('unigram_loss', float('nan')):.3f})")
    return path


def train_heads(args, workdir: Path) -> Path:
    from specheads.train import main as train_main

    heads_dir = workdir / "heads"
    if (heads_dir / "config.json").exists() and not args.retrain:
        print(f"reusing heads in {heads_dir} (pass --retrain to train again)")
        return heads_dir
    if args.retrain and workdir.exists():
        shutil.rmtree(workdir)
    recipe = args.recipe or str(default_recipe())
    rc = train_main([recipe, "--set", f"train.output_dir={workdir}", *sum((["--set", o] for o in args.overrides), [])])
    if rc != 0:
        raise RuntimeError(f"training failed with exit status {rc}")
    return heads_dir


def compare_decoding(target_path: str, heads_dir: Path, max_new_tokens: int) -> list:
    from specheads.bench.compare import compare, format_table
    from specheads.heads.heads_dir import read_heads_config
    from specheads.runner import load_decoder
    from specheads.serving.decode import SpeculativeDecoder

    speculative, tokenizer = load_decoder(target_path, str(heads_dir))
    target, tree, config = speculative.target, speculative.tree, read_heads_config(heads_dir)
    print(f"heads: {config.num_heads} Medusa heads x {config.num_layers} layer(s); tree of "
          f"{tree.num_nodes} nodes, depth {tree.max_depth}")
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in DEMO_PROMPTS]
    methods = {"engine, no heads": SpeculativeDecoder(target),
               "engine + Medusa heads": speculative}
    results = compare(methods, target.model, prompts, max_new_tokens, tokenizer.eos_token_id)
    print(format_table(results))
    return results


def run_demo(args) -> int:
    start = time.perf_counter()
    workdir = Path(args.workdir)
    _step("1/3 embedded target (built once, then cached)")
    target_path = build_target()
    _step("2/3 train Medusa heads with DeepSpeed")
    heads_dir = train_heads(args, workdir)
    _step(f"3/3 decode {len(DEMO_PROMPTS)} prompts x {args.max_new_tokens} new tokens, greedy")
    results = compare_decoding(target_path, heads_dir, args.max_new_tokens)
    hf, spec = results[0], results[-1]
    print(f"\nMedusa: alpha={spec.alpha:.3f} tau={spec.tau:.2f} speedup={spec.tokens_per_s / hf.tokens_per_s:.2f}x "
          f"over HF generate; outputs identical: {'yes' if spec.identical else 'NO'}")
    print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    print(f"\nTry it yourself:\n  specheads generate --target embedded:tiny --heads {heads_dir} "
          f"--prompt 'def main(' --max-new-tokens 64")
    if not all(r.identical for r in results[1:]):
        print("error: speculative output differed from HF greedy output", file=sys.stderr)
        return 1
    return 0
