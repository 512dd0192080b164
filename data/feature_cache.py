"""Optional offline hidden-state cache: run the target over the packed blocks once, store
what training reads from it, and read it back batch by batch.

    specheads data cache --target T --input SOURCE --taps 2,5,8 --output DIR [--max-gb G] [--top-k K]

Layout of DIR: `manifest.json` (target identity, taps, top-k, shapes, dtype, shard list)
and `shard-00000.safetensors`, ... each holding `blocks_per_shard` blocks:
  input_ids [n, T] int64, loss_mask [n, T] bool,
  tap_{layer} [n, T, H] in the target's dtype (one per requested tap layer),
  logits [n, T, V]                           when top_k is None (full logits), else
  topk_values [n, T, K] + topk_indices [n, T, K] int32 (the target's top-k logits).
Full logits are the default for vocabularies up to FULL_LOGITS_MAX_VOCAB (tiny targets);
larger vocabularies keep the top DEFAULT_TOP_K, which is what distillation needs (the rest
of the distribution is nearly zero mass) at a fraction of the size.

The total size is estimated and printed before anything is written, and the cache refuses
to start when it exceeds `max_gb`. Each shard is written to a temp name and renamed, and
the manifest is written last, so a directory with a manifest is always whole.

Training reads a cache with `data.feature_cache: DIR` (training/cached.py): the cache's
blocks are the training data and its taps + logits replace the target's forward. `blocks()`
gives the cached token ids as PackedBlocks (for the sampler and draft-vocab counts),
`check_fits` refuses a cache of another target, other taps or another block length, and
`teacher_logits` turns stored logits (full, or top-k with the rest at TOPK_FILL, which
softmax maps to exactly zero probability) into the dense [b, T, V] the losses take.

Shape legend: N blocks, T block length, H hidden size, V vocab, K top-k.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.data.text import DataError, PackedBlocks
from specheads.heads import atomic

FORMAT_VERSION = 1
FULL_LOGITS_MAX_VOCAB = 4096
DEFAULT_TOP_K = 64
MANIFEST = "manifest.json"
TOPK_FILL = -1e9  # logit of tokens outside the stored top-k: finite, so 0 * log p stays 0


def resolve_top_k(top_k: int | None, vocab_size: int) -> int | None:
    """None (full logits) or a K < vocab; "auto" (-1) picks by vocab size."""
    if top_k is not None and top_k < 0:
        top_k = None if vocab_size <= FULL_LOGITS_MAX_VOCAB else DEFAULT_TOP_K
    return None if top_k is None or top_k == 0 or top_k >= vocab_size else top_k


def estimate_bytes(num_blocks: int, seq_len: int, hidden_size: int, num_taps: int, vocab_size: int,
                   top_k: int | None, dtype: torch.dtype) -> int:
    positions = num_blocks * seq_len
    width = torch.finfo(dtype).bits // 8
    logits = positions * vocab_size * width if top_k is None else positions * top_k * (width + 4)
    return positions * (8 + 1) + positions * hidden_size * num_taps * width + logits


@torch.no_grad()
def _features(target, input_ids: torch.Tensor, taps: list[int], top_k: int | None) -> dict[str, torch.Tensor]:
    out = target(input_ids.to(target.device), taps)
    features = {f"tap_{layer}": tap.cpu() for layer, tap in zip(taps, out.taps)}  # each [b, T, H]
    if top_k is None:
        features["logits"] = out.logits.cpu()  # [b, T, V]
    else:
        values, indices = out.logits.topk(top_k, dim=-1)  # [b, T, K]
        features["topk_values"], features["topk_indices"] = values.cpu(), indices.to(torch.int32).cpu()
    return features


def write_cache(target, blocks: PackedBlocks, taps: list[int], out_dir: str | Path, *, top_k: int | None = -1,
                batch_size: int = 8, blocks_per_shard: int = 256, max_gb: float | None = None, log=print,
                progress: bool = True) -> Path:
    """Cache the target's taps and logits over `blocks` into `out_dir`; -> the manifest path.
    `progress`: a tqdm bar over the blocks (on stderr)."""
    target.check_taps(taps)
    out = Path(out_dir)
    if (out / MANIFEST).exists():
        raise DataError(f"{out} already holds a feature cache ({MANIFEST}); choose another --output or remove it")
    num_blocks, seq_len = blocks.input_ids.shape
    top_k = resolve_top_k(top_k, target.vocab_size)
    total = estimate_bytes(num_blocks, seq_len, target.hidden_size, len(taps), target.vocab_size, top_k, target.dtype)
    log(f"feature cache: {num_blocks} blocks x {seq_len} tokens, taps {taps}, "
        f"{'full logits' if top_k is None else f'top-{top_k} logits'}: about {total / 1e9:.3f} GB ({total} bytes)")
    if max_gb is not None and total > max_gb * 1e9:
        raise DataError(f"the feature cache would take {total / 1e9:.3f} GB, over the limit of {max_gb} GB "
                        "(--max-gb); cache fewer records, fewer taps or a smaller --top-k")
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    shards = []
    bar = tqdm(total=num_blocks, desc="feature cache", unit="block", disable=not progress)
    for shard_start in range(0, num_blocks, blocks_per_shard):
        indices = list(range(shard_start, min(num_blocks, shard_start + blocks_per_shard)))
        parts: dict[str, list[torch.Tensor]] = {}
        for start in range(0, len(indices), batch_size):
            input_ids, _ = blocks.batch(indices[start:start + batch_size])
            for name, tensor in _features(target, input_ids, taps, top_k).items():
                parts.setdefault(name, []).append(tensor)
            bar.update(len(input_ids))
        input_ids, loss_mask = blocks.batch(indices)
        tensors = {"input_ids": input_ids, "loss_mask": loss_mask,
                   **{name: torch.cat(chunks) for name, chunks in parts.items()}}
        name = f"shard-{len(shards):05d}.safetensors"
        with atomic.temp_path(out / name) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        shards.append({"file": name, "num_blocks": len(indices)})
        log(f"feature cache: wrote {name} ({shard_start + len(indices)}/{num_blocks} blocks)")
    bar.close()
    manifest = {"format_version": FORMAT_VERSION, "target": dataclasses.asdict(target.identity),
                "taps": list(taps), "top_k": top_k,
        "num_blocks": num_blocks, "seq_len": seq_len, "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "dtype": str(target.dtype).removeprefix("torch."),
        "source": blocks.report.summary(), "total_bytes": total, "shards": shards}
    atomic.write_json(out / MANIFEST, manifest, indent=1, default=str)
    return out / MANIFEST


class FeatureCache:
    """Reads a cache written by write_cache; `batch(indices)` mirrors PackedBlocks.batch."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = self.directory / MANIFEST
        if not manifest.exists():
            raise DataError(f"{self.directory} has no {MANIFEST}: not a feature cache, or its writing did not finish")
        self.manifest = json.loads(manifest.read_text())
        if self.manifest["format_version"] != FORMAT_VERSION:
            raise DataError(f"{manifest}: format_version {self.manifest['format_version']}, expected {FORMAT_VERSION}")
        self.taps: list[int] = self.manifest["taps"]
        self._starts, start = [], 0
        for shard in self.manifest["shards"]:
            self._starts.append(start)
            start += shard["num_blocks"]
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return self.manifest["num_blocks"]

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} is out of range for a cache of {len(self)} blocks")
        shard = max(i for i, start in enumerate(self._starts) if start <= index)
        return shard, index - self._starts[shard]

    def _handle(self, shard: int):
        if shard not in self._handles:
            path = self.directory / self.manifest["shards"][shard]["file"]
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """-> {"input_ids" [b, T], "loss_mask" [b, T], "tap_{l}" [b, T, H], "logits" [b, T, V] or
        "topk_values"/"topk_indices" [b, T, K]}, rows in the order of `indices`."""
        rows: dict[str, list[torch.Tensor]] = {}
        for index in indices:
            shard, row = self._locate(index)
            handle = self._handle(shard)
            for name in handle.keys():
                rows.setdefault(name, []).append(handle.get_slice(name)[row:row + 1])
        return {name: torch.cat(parts) for name, parts in rows.items()}

    def blocks(self) -> PackedBlocks:
        """All cached blocks' token ids and loss masks, in cache order."""
        from specheads.data.text import DataReport

        parts = [self._handle(i) for i in range(len(self.manifest["shards"]))]
        input_ids = torch.cat([h.get_tensor("input_ids") for h in parts])
        loss_mask = torch.cat([h.get_tensor("loss_mask") for h in parts])
        report = DataReport(source=f"feature cache {self.directory} ({self.manifest.get('source', '?')})",
                            num_records=len(self), num_documents=len(self),
                            num_tokens=int(loss_mask.sum()), num_blocks=len(self))
        return PackedBlocks(input_ids, loss_mask, report)

    def check_fits(self, identity, taps: list[int], seq_len: int) -> None:
        """Raise a DataError naming what differs when this cache cannot stand in for `identity`'s
        forward over blocks of `seq_len` tokens reading `taps`."""
        saved = self.manifest["target"]
        problems = [f"{name}: cache {saved.get(name)!r}, target {getattr(identity, name)!r}"
                    for name in ("model_type", "hidden_size", "vocab_size", "num_layers")
                    if saved.get(name) != getattr(identity, name)]
        missing = sorted(set(taps) - set(self.taps))
        if missing:
            problems.append(f"taps {missing} are not cached (cached taps {self.taps}; write the cache with "
                            f"--taps {','.join(str(t) for t in sorted(set(taps) | set(self.taps)))})")
        if self.manifest["seq_len"] != seq_len:
            problems.append(f"blocks of {self.manifest['seq_len']} tokens, but data.seq_len is {seq_len}")
        if problems:
            raise DataError(f"feature cache {self.directory} does not fit this run: " + "; ".join(problems))

    @staticmethod
    def teacher_logits(batch: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor:
        """-> [b, T, V] float32 logits: the stored full logits, or the top-k scattered over TOPK_FILL."""
        if "logits" in batch:
            return batch["logits"].float()
        values, indices = batch["topk_values"].float(), batch["topk_indices"].long()
        dense = torch.full((*values.shape[:-1], vocab_size), TOPK_FILL, dtype=torch.float32)
        return dense.scatter_(-1, indices, values)

    @staticmethod
    def teacher_draft_logits(batch: dict[str, torch.Tensor], vocab_size: int,
                             draft_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits over the draft vocab [b, T, Vd], the full-vocab argmax [b, T] as target ids).

        The same values as teacher_logits(...)[..., draft_ids] and its argmax, without the dense
        [b, T, V] (400 MB a batch of 4 x 512 over SmolLM2's 49k vocab): a top-k cache's k entries
        are scattered straight into the draft vocab (entries outside it dropped), and the argmax
        is the lowest-id entry among the top-k's largest value (argmax's first maximum).
        draft_ids [Vd]: target id of each draft id, ascending or not; None: Vd = V."""
        if "logits" in batch or draft_ids is None:
            dense = FeatureCache.teacher_logits(batch, vocab_size)
            restricted = dense if draft_ids is None else dense.index_select(-1, draft_ids.to(dense.device))
            return restricted, dense.argmax(-1)
        values, indices = batch["topk_values"].float(), batch["topk_indices"].long()  # [b, T, K]
        draft_size = draft_ids.numel()
        to_draft = torch.full((vocab_size,), draft_size, dtype=torch.long)  # draft_size: "not in the draft vocab"
        to_draft[draft_ids.cpu()] = torch.arange(draft_size)
        dense = torch.full((*values.shape[:-1], draft_size + 1), TOPK_FILL, dtype=torch.float32)
        dense.scatter_(-1, to_draft[indices], values)  # tokens outside the draft vocab land in the last column
        best = values.max(-1, keepdim=True).values  # [b, T, 1]
        argmax = torch.where(values == best, indices, vocab_size).min(-1).values  # [b, T]
        return dense[..., :draft_size].contiguous(), argmax

    def iter_batches(self, batch_size: int):
        """Blocks in order, batch_size at a time (the last batch may be smaller)."""
        for start in range(0, len(self), batch_size):
            yield self.batch(list(range(start, min(len(self), start + batch_size))))
