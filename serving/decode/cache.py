"""A preallocated KV cache for tree decoding: write the tree, commit the accepted path in place.

`TreeStaticCache` is a transformers `Cache` subclass (the public extension point; no modeling
code is copied or patched). Every layer's keys and values [B, kv_heads, max_cache_len, D] are
views of one buffer [L, 2, B, kv_heads, max_cache_len, D], allocated once on the first forward
(dtype, device, head count and head size come from the model's own key states) and never
reallocated, so that moving entries (a commit, a row swap) is one copy for the whole model.
`max_cache_len` must cover the longest context plus the largest tree a verify step writes.
A scheduler's row moves (reset, truncate, swap, move, and the per-row tensors that follow the
rows) are serving/decode/cache_rows.py's `CacheRows`, mixed in here.

Lengths. The cache keeps one committed length per sequence twice: on the buffers' device
(`lengths.device_lens` [B], what a decode step reads and advances) and on the host
(`seq_lens`, what sizes the dynamic shapes and the capacity check without a device read).
A forward writes its T new entries at [seq_lens[b], seq_lens[b] + T) in every layer and
leaves them *pending*: they are attended to by that forward but not counted as committed.
Then exactly one of
- `commit()` keeps all T pending entries in order (prefill, plain one-token decoding);
- `commit(accepted_node_indices)` with host indices gathers the accepted tree nodes
  (offsets into the pending entries, path order, root first) to [seq_lens[b], seq_lens[b] + A)
  (a prefill of several prompts; its index tensors are built on the host);
- `commit_accepted(path, num_nodes)`, a decode step's: the paths and counts are device
  tensors, the gather has a fixed shape and the device lengths advance by a tensor add, so
  nothing travels from the host; the host copy advances later, from the step's one read
  (`count_committed`);
- nothing: the next forward overwrites the pending entries (they are dropped).
`crop(n)` shortens the committed length (n >= 0: keep n positions; n < 0: remove -n, the
transformers 5 convention). Entries past the committed length are dead data, never read
unmasked.

`get_seq_length()` is the committed length, before, during and after a forward until the
next commit: it is the position of the forward's first query and the number of keys that
precede the new ones, which is what transformers derives from it when it builds positions
(`position_ids = arange(T) + get_seq_length()`) or a causal mask (`q_offset`, and
`get_mask_sizes`). A tree verify passes its own position_ids and a 4-D mask, so the model
then reads neither. With B > 1 and unequal lengths it returns the longest; pass explicit
position_ids and a 4-D mask (`attention_mask()` builds one) in that case.

Two shapes for what attention sees (`static_shape`):
- False (dynamic): `update` returns views of [0, max(seq_lens) + T). The verify mask is
  [B, 1, T, max(seq_lens) + T], exactly the [1, 1, T, S + T] mask of `serving.decode.steps`.
- True (static): `update` returns the whole [0, max_cache_len) buffers, so every tensor
  shape is fixed whatever the length: the draft and verify forwards can be captured once
  as CUDA graphs (positions and lengths live in device tensors). The mask is then
  [B, 1, T, max_cache_len] with every column past the sequence's own keys masked out.
  Layers report `is_compileable`, so transformers' own causal masks (prefill, chains
  without a 4-D mask) are sized max_cache_len and never skipped for one-token queries.
`attention_mask(tree_mask_TT)` builds the right mask for either shape.

Sliding-window and other non-full-attention layers are refused: a tree needs every
position kept.

Shape legend: B batch, T new (tree) tokens, A accepted nodes, S committed length,
M max_cache_len, D head size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specheads.serving.decode.cache_rows import CacheRows


# From this many active rows on, a forward writes its keys/values with one index_put per layer
# instead of one slice copy per row: 32 rows x 30 layers of SmolLM2 took 5.6 ms a step as
# slices and 1.1 ms as index_puts; below 4 rows the slices are cheaper (3 vs 10 us a row).
INDEX_PUT_ROWS = 4
OVERFLOW = ("TreeStaticCache overflow: {} positions needed (committed {} + {} new) but max_cache_len is {}; build "
            "the cache with a larger max_cache_len")


class _Lengths:
    """Committed lengths shared by all layers of one cache, and the last forward's T."""

    def __init__(self, batch_size: int, device: torch.device | None):
        self.host = [0] * batch_size  # [B] python ints, no device sync to read
        self.device_lens = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] on the buffers' device
        self.num_pending = 0  # T written by the last forward, not yet committed
        self.start, self.stop = 0, batch_size  # the active rows [start, stop) (see TreeStaticCache.set_rows)

    @property
    def active(self) -> list[int]:
        """Committed lengths of the active rows (host)."""
        return self.host[self.start:self.stop]

    @property
    def active_device(self) -> torch.Tensor:
        return self.device_lens[self.start:self.stop]


class _Storage:
    """Every layer's keys and values in ONE buffer [L, 2, B, kv_heads, M, D], allocated when the
    first layer runs (dtype, device, head count and size come from its key states): a commit,
    a row swap or a row move is one indexed copy for the whole model, not one per layer and
    buffer (a GPU pays per launch). Every layer must have the same KV shape."""

    def __init__(self, num_layers: int, batch_size: int, max_cache_len: int):
        self.num_layers, self.batch_size, self.max_cache_len = num_layers, batch_size, max_cache_len
        self.buffer: torch.Tensor | None = None  # [L, 2, B, kv_heads, M, D]

    def layer_views(self, index: int, key_states: torch.Tensor,
                    value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values [B, kv_heads, M, D] (views of the buffer)."""
        num_heads, head_dim = key_states.shape[1], key_states.shape[-1]
        if self.buffer is None:
            self.buffer = torch.zeros(self.num_layers, 2, self.batch_size, num_heads, self.max_cache_len, head_dim,
                                      dtype=key_states.dtype, device=key_states.device)
        expected = tuple(self.buffer.shape[3:4]) + tuple(self.buffer.shape[5:])
        for name, states in (("keys", key_states), ("values", value_states)):
            if (states.shape[1], states.shape[-1]) != expected or states.dtype != self.buffer.dtype:
                raise NotImplementedError(
                    f"layer {index}'s {name} are {states.dtype} with {states.shape[1]} heads of size "
                    f"{states.shape[-1]}, but the cache holds {self.buffer.dtype} with {expected[0]} heads of size "
                    f"{expected[1]}: TreeStaticCache needs one KV shape in every layer")
        return self.buffer[index, 0], self.buffer[index, 1]


class TreeStaticLayer(CacheLayerMixin):
    """One layer's preallocated keys/values; the lengths live in the shared `_Lengths`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, max_cache_len: int, lengths: _Lengths, static_shape: bool, storage: "_Storage", index: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.lengths = lengths
        self.storage, self.index = storage, index
        self.static_shape = static_shape
        self.is_compileable = static_shape  # instance attribute: Cache.is_compileable reads it

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Views of this layer's keys and values in the cache's one buffer (allocated by the
        first layer that runs, for every layer: see `_Storage`)."""
        keys, values = self.storage.layer_views(self.index, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = keys, values
        if self.lengths.device_lens.device != key_states.device:  # a cache built without its device
            self.lengths.device_lens = self.lengths.device_lens.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value states [B, kv_heads, T, D] at [seq_lens, seq_lens + T) (pending).

        `cache_kwargs["cache_position"]` ([T] or [B, T]), when a model passes one, overrides
        the slots written; transformers 5 decoders pass none.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        lengths = self.lengths
        start, stop = lengths.start, lengths.stop
        active = lengths.host[start:stop]  # host lengths: read without a device sync
        if key_states.shape[0] != stop - start:
            raise ValueError(f"the cache's active rows are [{start}, {stop}) ({stop - start} sequences), "
                             f"got key states for batch size {key_states.shape[0]}")
        keys, values = self.keys[start:stop], self.values[start:stop]  # views
        num_new = key_states.shape[-2]
        # Host ints only: no device sync. Not read with static shapes (a compiled step would guard,
        # and recompile, on every length): the engine sizes every request to the cache then.
        needed = self.max_cache_len if self.static_shape else max(active) + num_new
        if needed > self.max_cache_len:
            raise ValueError(OVERFLOW.format(needed, max(active), num_new, self.max_cache_len))
        cache_kwargs = args[0] if args and isinstance(args[0], dict) else kwargs.get("cache_kwargs") or {}
        slots_BT = cache_kwargs.get("cache_position")
        if slots_BT is None and not self.static_shape and len(active) < INDEX_PUT_ROWS:
            # Eager path, few rows: one slice copy per row at its host-known length (an index_put
            # per layer costs more than the rest of a small model's decode step on a CPU).
            for row, length in enumerate(active):
                keys[row, :, length:length + num_new] = key_states[row]
                values[row, :, length:length + num_new] = value_states[row]
            self.lengths.num_pending = num_new
            return keys[:, :, :needed], values[:, :, :needed]
        if slots_BT is None:  # many rows, or static shapes: one index_put at the device lengths
            slots_BT = lengths.device_lens[start:stop, None] + torch.arange(num_new, device=self.device)
        slots_BT = slots_BT.expand(key_states.shape[0], num_new)
        batch_B1 = torch.arange(key_states.shape[0], device=self.device)[:, None]
        # Advanced indices on dims 0 and 2 put their broadcast [B, T] first: values are [B, T, H, D].
        keys[batch_B1, :, slots_BT] = key_states.transpose(1, 2)
        values[batch_B1, :, slots_BT] = value_states.transpose(1, 2)
        self.lengths.num_pending = num_new
        if self.static_shape:
            return keys, values
        return keys[:, :, :needed], values[:, :, :needed]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static_shape:
            return self.max_cache_len, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return max(self.lengths.active)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Lengths are shared: `TreeStaticCache.crop` changes them once for every layer."""

    def reset(self) -> None:
        """The cache's one buffer is zeroed by `TreeStaticCache.reset`."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TreeStaticCache does not support beam search")


@dataclass
class DirectWrites:
    """Where a forward that writes its keys and values itself puts them (`TreeStaticCache.direct_writes`):
    rows [L, 2, n, kv_heads, K, D] is a view of the cache's buffer (the active rows, the K keys the
    forward attends to): layer i's keys rows[i, 0], its values rows[i, 1]; row b's T new entries go
    to slots [starts[b], starts[b] + T) (CPU int64 [n])."""

    rows: torch.Tensor
    starts: torch.Tensor


def _in_place(accepted) -> bool:
    """Whether accepted node offsets ([A] list or tensor) are 0, 1, ..., A-1 (no entry moves).
    A tensor is checked on a CPU only: on a GPU the check would cost a device sync, more than
    the gather it saves (the engine passes host lists)."""
    if not isinstance(accepted, torch.Tensor):
        return list(accepted) == list(range(len(accepted)))
    if accepted.device.type != "cpu":
        return False
    return bool((accepted == torch.arange(accepted.shape[0])).all())


class TreeStaticCache(CacheRows, Cache):
    """Preallocated per-layer KV buffers with per-sequence committed lengths (see the module doc).

    config: the target's model config. max_cache_len: longest context + largest tree.
    batch_size: number of sequences B. static_shape: return the whole buffers from `update`
    (fixed shapes, for CUDA graphs) instead of views of the used prefix. device: where the
    lengths live from the start (default: moved to the buffers' device on the first forward).
    """

    def __init__(self, config, max_cache_len: int, batch_size: int = 1, static_shape: bool = False,
                 device: torch.device | str | None = None):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = text_config.num_hidden_layers
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers
        for layer_index, layer_type in enumerate(layer_types):
            if layer_type != "full_attention":
                raise NotImplementedError(
                    f"layer {layer_index} is a {layer_type!r} layer; tree decoding needs full-attention "
                    "layers whose cache holds every position")
        if max_cache_len < 1 or batch_size < 1:
            raise ValueError(f"max_cache_len and batch_size must be >= 1, got {max_cache_len} and {batch_size}")
        self.max_cache_len = max_cache_len
        self.static_shape = static_shape
        self.lengths = _Lengths(batch_size, device)
        self.storage = _Storage(len(layer_types), batch_size, max_cache_len)
        self.followers: list[tuple[torch.Tensor, int]] = []  # (tensor, its row dim): rows that move with these
        super().__init__(layers=[TreeStaticLayer(max_cache_len, self.lengths, static_shape, self.storage, index)
                                 for index in range(len(layer_types))])

    @property
    def seq_lens(self) -> list[int]:
        """[B] committed lengths of the active rows (host copy)."""
        return list(self.lengths.active)

    @property
    def num_pending(self) -> int:
        """T entries written by the last forward and not yet committed (0 after a commit)."""
        return self.lengths.num_pending

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The committed length (the longest active one when B > 1); pending entries do not count."""
        return max(self.lengths.active)

    @property
    def capacity(self) -> int:
        """Rows allocated (the largest batch this cache holds)."""
        return len(self.lengths.host)

    def set_rows(self, start: int, stop: int, pending_written: bool = False) -> None:
        """Make rows [start, stop) the active batch: forwards read and write only those rows,
        and commit/attention_mask/position_ids/seq_lens refer to them (row start is batch
        index 0). A scheduler prefills one new sequence alone in its row, then decodes the
        rows [0, n) together. pending_written: the caller wrote the same number of pending
        entries into every new active row (one forward per row), to be committed together."""
        if not 0 <= start < stop <= len(self.lengths.host):
            raise ValueError(f"rows [{start}, {stop}) are outside the cache's {len(self.lengths.host)} rows")
        if self.lengths.num_pending and not pending_written:
            raise ValueError("set_rows between a forward and its commit would drop the pending entries")
        self.lengths.start, self.lengths.stop = start, stop

    def direct_writes(self, num_new: int) -> DirectWrites | None:
        """For a forward that writes its num_new keys and values per row itself, in every layer
        (heads/target/cpu_decoder.py's fused CPU forward), instead of calling `update` per layer:
        the views it writes to and attends to, with `update`'s bookkeeping done once (the entries
        become pending; an overflow is refused). None where `update` must run: static shapes, or
        before the first forward (which allocates the buffer), or a buffer off the CPU."""
        buffer = self.storage.buffer
        if self.static_shape or buffer is None or buffer.device.type != "cpu":
            return None
        lengths = self.lengths
        active = lengths.host[lengths.start:lengths.stop]
        needed = max(active) + num_new
        if needed > self.max_cache_len:
            raise ValueError(OVERFLOW.format(needed, max(active), num_new, self.max_cache_len))
        lengths.num_pending = num_new
        rows = buffer[:, :, lengths.start:lengths.stop, :, :needed]  # [L, 2, n, kv_heads, K, D]
        return DirectWrites(rows, torch.tensor(active, dtype=torch.int64))

    def drop_pending(self) -> None:
        """Forget the last forward's pending entries (a step that failed after its forward): the
        next forward overwrites them."""
        self.lengths.num_pending = 0

    def commit(self, accepted_node_indices: torch.Tensor | Sequence | None = None, *,
               num_kept: Sequence[int] | None = None) -> None:
        """Keep the accepted pending entries, in path order, right after the committed ones.

        accepted_node_indices: None keeps all pending entries as they are (no copy); a [A]
        long tensor or list (offsets into the last forward's T entries, root first) for
        B = 1 or for the same path in every sequence; a [B, A] tensor; or a length-B list
        with one entry per sequence: an [A_b] tensor or list (lengths may differ), or None,
        which keeps that sequence's first num_kept[b] pending entries where they are (default
        all): a plain step, or a path that accepted only its root. Nothing moves for those,
        and a GPU is spared the copies. The entries that do move, in every sequence, move in
        one gather per buffer and layer.
        """
        num_pending = self.lengths.num_pending
        start, num_rows = self.lengths.start, self.lengths.stop - self.lengths.start
        if accepted_node_indices is None:
            per_sequence = [None] * num_rows
        elif isinstance(accepted_node_indices, torch.Tensor) and accepted_node_indices.dim() == 2:
            per_sequence = list(accepted_node_indices)
        elif isinstance(accepted_node_indices, (list, tuple)) and accepted_node_indices \
                and not isinstance(accepted_node_indices[0], int):
            per_sequence = list(accepted_node_indices)
        else:
            per_sequence = [accepted_node_indices] * num_rows
        if len(per_sequence) != num_rows or (num_kept is not None and len(num_kept) != num_rows):
            kept = "" if num_kept is None else f" and {len(num_kept)} kept counts"
            raise ValueError(f"commit got {len(per_sequence)} accepted paths{kept} for batch size {num_rows}")
        device = self.lengths.device_lens.device
        moves = []  # (row, its committed length, accepted offsets on the device)
        for row, accepted in enumerate(per_sequence):
            batch_index = start + row
            if accepted is None:
                num_accepted, accepted_A = num_pending if num_kept is None else num_kept[row], None
            else:
                num_accepted, accepted_A = len(accepted), accepted
            if num_accepted > num_pending:
                raise ValueError(f"commit of {num_accepted} nodes for sequence {batch_index}, but the last "
                                 f"forward wrote only {num_pending} pending entries")
            if accepted_A is not None and not _in_place(accepted_A):  # a chain's prefix is where it belongs
                moves.append((batch_index, self.lengths.host[batch_index],
                              torch.as_tensor(accepted_A, dtype=torch.long, device=device)))
            self.lengths.host[batch_index] += num_accepted
        if moves:
            rows, dst, offsets = [], [], []
            for row, length, accepted_A in moves:
                num_accepted = int(accepted_A.shape[0])
                rows += [row] * num_accepted
                dst += range(length, length + num_accepted)
                offsets += [length] * num_accepted
            src_M = torch.cat([accepted_A for _, _, accepted_A in moves]) + torch.tensor(offsets, device=device)
            rows_M, dst_M = torch.tensor(rows, device=device), torch.tensor(dst, device=device)
            buffer = self.storage.buffer  # every layer's keys and values at once (every source read first)
            if buffer is not None:
                buffer[:, :, rows_M, :, dst_M] = buffer[:, :, rows_M, :, src_M]
        self._sync_device_lens()

    def commit_accepted(self, path_nW: torch.Tensor, num_nodes_n: torch.Tensor) -> None:
        """A decode step's commit, on the device: each active row keeps its accepted pending
        entries (path_nW: node offsets into the last forward's entries, root first, padded past
        the row's num_nodes_n), in path order, right after its committed ones, and its device
        length advances by num_nodes_n. Every row moves W entries per layer (the padding lands
        past the new length: dead data), so the shapes are fixed and nothing comes from the
        host; `count_committed` advances the host lengths once the counts are read."""
        start, stop = self.lengths.start, self.lengths.stop
        lens_n = self.lengths.device_lens[start:stop]  # a view: the add below advances device_lens
        buffer = self.storage.buffer
        if buffer is not None:
            rows_n1 = torch.arange(start, stop, device=buffer.device)[:, None]
            dst_nW = lens_n[:, None] + torch.arange(path_nW.shape[1], device=buffer.device)
            # advanced indices on dims 2 and 4: every source is read before any entry is written
            buffer[:, :, rows_n1, :, dst_nW] = buffer[:, :, rows_n1, :, lens_n[:, None] + path_nW]
        lens_n.add_(num_nodes_n)
        self.lengths.num_pending = 0

    def count_committed(self, num_nodes: Sequence[int]) -> None:
        """The host lengths of the active rows advance by what `commit_accepted` kept (read
        back with the step's tokens)."""
        for row, count in enumerate(num_nodes, start=self.lengths.start):
            self.lengths.host[row] += count

    def crop(self, max_length: int) -> None:
        """Keep the first max_length committed positions (max_length < 0: remove -max_length)."""
        for batch_index, length in enumerate(self.lengths.host[self.lengths.start:self.lengths.stop],
                                             start=self.lengths.start):
            keep = length + max_length if max_length < 0 else min(max_length, length)
            self.lengths.host[batch_index] = max(keep, 0)
        self._sync_device_lens()

    def reset(self) -> None:
        """Empty the cache; the buffers stay allocated (and are zeroed)."""
        self.lengths.host = [0] * len(self.lengths.host)
        self._sync_device_lens()
        if self.storage.buffer is not None:
            self.storage.buffer.zero_()

    def _sync_device_lens(self) -> None:
        self.lengths.num_pending = 0
        # In place, so a captured graph that reads device_lens sees the new lengths.
        self.lengths.device_lens.copy_(torch.tensor(self.lengths.host, dtype=torch.long))

    def attention_mask(self, tree_mask_TT: torch.Tensor | None = None, num_new: int | None = None) -> torch.Tensor:
        """The bool 4-D mask [B, 1, T, K] (True = attend) for the next forward of T new tokens.

        Row i attends to its sequence's committed keys and to the new tokens tree_mask_TT[i]
        allows (default: causal); tree_mask_TT is [T, T] (one tree for every sequence) or
        [B, T, T] (one per sequence). K = max(seq_lens) + T (dynamic) or max_cache_len (static).
        Every key column outside those is masked, including other sequences' longer prefixes.
        """
        device = self.lengths.device_lens.device
        if tree_mask_TT is None:
            tree_mask_TT = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
        num_new = tree_mask_TT.shape[-1]
        start, stop = self.lengths.start, self.lengths.stop
        num_keys = self.max_cache_len if self.static_shape else max(self.lengths.host[start:stop]) + num_new
        lens_B11 = self.lengths.device_lens[start:stop, None, None]
        key_K = torch.arange(num_keys, device=device)
        committed_BTK = (key_K < lens_B11).expand(-1, num_new, -1)
        offset_BK = key_K - lens_B11[:, 0]  # key's offset among the new tokens
        in_tree_BK = (offset_BK >= 0) & (offset_BK < num_new)
        index_BTK = offset_BK.clamp(0, num_new - 1)[:, None].expand(-1, num_new, -1)
        tree_BTT = tree_mask_TT.expand(index_BTK.shape[0], num_new, num_new)
        tree_BTK = tree_BTT.gather(-1, index_BTK)
        return (committed_BTK | (tree_BTK & in_tree_BK[:, None])).unsqueeze(1)

    def position_ids(self, position_offsets_T: torch.Tensor) -> torch.Tensor:
        """[B, T] positions of the new tokens: committed length + offset (depth for a tree);
        offsets [T] (shared) or [B, T]."""
        offsets = position_offsets_T if position_offsets_T.dim() == 2 else position_offsets_T[None]
        return self.lengths.device_lens[self.lengths.start:self.lengths.stop, None] + offsets
