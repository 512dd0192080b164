"""What one greedy EAGLE-3 decode step crosses: the specheads functions and files entered during
one `BatchEngine.step`, so that the count issue 25 asks for is reproducible.

    python -m specheads.bench.tools.decode_trace [--warmup-steps 2] [--tree static|dynamic]

It builds a tiny random Llama target (4 layers, saved and loaded through `from_pretrained` in
a temporary directory) and a random EAGLE-3 head over it, decodes one prompt as a batch of
one with the engine's defaults (greedy, sdpa verify, the default fallback policy, the default
static tree or, with `--tree dynamic`, an EAGLE-2 tree), runs `--warmup-steps` steps, then
records exactly one step with `sys.setprofile`.

Counted: every Python function whose code lives in a file of the parts that the decode path
may reach (heads/, serving/, data/, training/), including those that transformers calls back
(the KV cache, the tree attention). Lambdas and comprehensions are listed apart and not
counted as functions, and so are methods that dataclasses generate (`__init__`, `__eq__`):
they have no file. torch, transformers and the standard library are not counted. It times
nothing; the figures are counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

PARTS = ("heads", "serving", "data", "training")
ANONYMOUS = ("<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def part_roots() -> dict[Path, str]:
    """Each part's source folder -> its name (found without importing the part)."""
    roots = {}
    for part in PARTS:
        spec = importlib.util.find_spec(f"specheads.{part}")
        for location in spec.submodule_search_locations or []:
            roots[Path(location).resolve()] = part
    return roots


class StepTrace:
    """The specheads code objects entered while it is active (a context manager)."""

    def __init__(self):
        self.roots = part_roots()
        self.entered: set = set()  # code objects of files under the parts
        self.generated: set[str] = set()  # dataclass-made methods of specheads classes: "module.qualname"
        self._files: dict[str, str | None] = {}  # co_filename -> its path relative to the repo, None: not ours

    def _relative(self, filename: str) -> str | None:
        if filename not in self._files:
            path, found = Path(filename).resolve(), None
            for root, part in self.roots.items():
                if path.is_relative_to(root):
                    found = f"{part}/{path.relative_to(root)}"
            self._files[filename] = found
        return self._files[filename]

    def _profile(self, frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if self._relative(code.co_filename) is not None:
            self.entered.add(code)
        elif code.co_filename == "<string>" and str(frame.f_globals.get("__name__", "")).startswith("specheads."):
            self.generated.add(f"{frame.f_globals['__name__']}.{code.co_qualname}")

    def __enter__(self) -> "StepTrace":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def report(self) -> dict:
        """{"functions": {file: [qualname]}, "anonymous": {file: [qualname]}, "generated": [...],
        "num_functions", "num_files"}."""
        functions, anonymous = defaultdict(set), defaultdict(set)
        for code in self.entered:
            kind = anonymous if code.co_name in ANONYMOUS else functions
            kind[self._relative(code.co_filename)].add(code.co_qualname)
        return {"functions": {f: sorted(names) for f, names in sorted(functions.items())},
                "anonymous": {f: sorted(names) for f, names in sorted(anonymous.items())},
                "generated": sorted(self.generated),
                "num_functions": sum(map(len, functions.values())), "num_files": len(functions)}


def tiny_eagle3_decoder(directory: Path, dynamic: bool):
    """A SpeculativeDecoder over a tiny random Llama (saved to and loaded from `directory`) with
    a random EAGLE-3 head (peaked weights, as the tests' random heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specheads.heads.draft_vocab import build_draft_vocab
    from specheads.heads.artefacts.heads_dir import build_heads, eagle_heads_config
    from specheads.heads.target.adapter import TargetAdapter
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DynamicTreeConfig

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    _peak(model)
    model.save_pretrained(directory)
    target = TargetAdapter.from_pretrained(directory)
    head_config = eagle_heads_config(target, num_steps=4, draft_vocab_size=200)
    head = build_heads(head_config)
    _peak(head)
    head.set_draft_vocab(*build_draft_vocab(torch.randint(0, 1000, (256,)), 200, [2]))
    tree = DynamicTreeConfig(depth=4, top_k=4, num_nodes=12) if dynamic else None
    return SpeculativeDecoder(target, head.eval(), tree, tap_layers=head_config.tap_layers)


def _peak(module: torch.nn.Module) -> None:
    """Random init gives near-uniform logits; a wider spread makes them peaked like a trained model's."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)


def trace_one_step(decoder, warmup_steps: int = 2) -> dict:
    """Prefill one prompt, run warmup_steps steps, trace the next one -> StepTrace.report()."""
    from specheads.serving.decode.engine import BatchEngine
    from specheads.serving.decode.sequence import SequenceRequest

    prompt = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    max_new_tokens = 8 * (warmup_steps + 2)
    engine = BatchEngine(decoder, max_batch_size=1,
                         max_cache_len=len(prompt) + max_new_tokens + decoder.max_tree_nodes)
    seq = engine.check(SequenceRequest(prompt, max_new_tokens))
    engine.add(seq)
    for _ in range(warmup_steps):
        engine.step()
    if seq.finish_reason is not None:
        raise RuntimeError(f"the sequence finished ({seq.finish_reason}) before the traced step")
    with StepTrace() as trace:
        engine.step()
    return trace.report()


def format_report(report: dict) -> str:
    lines = []
    for filename, names in report["functions"].items():
        lines.append(f"{filename} ({len(names)})")
        lines += [f"    {name}" for name in names]
    for title, groups in (("lambdas and comprehensions (not counted)", report["anonymous"]),):
        if groups:
            lines.append(title)
            lines += [f"    {filename}: {name}" for filename, names in groups.items() for name in names]
    if report["generated"]:
        lines.append("generated by dataclasses (not counted)")
        lines += [f"    {name}" for name in report["generated"]]
    lines.append(f"one greedy EAGLE-3 decode step: {report['num_functions']} functions in {report['num_files']} files")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=2, help="decode steps before the traced one")
    parser.add_argument("--tree", choices=("static", "dynamic"), default="static",
                        help="the engine's default static tree, or an EAGLE-2 dynamic tree")
    args = parser.parse_args(argv)
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    with tempfile.TemporaryDirectory() as directory:
        decoder = tiny_eagle3_decoder(Path(directory), args.tree == "dynamic")
        print(format_report(trace_one_step(decoder, args.warmup_steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
