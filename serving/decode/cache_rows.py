"""The row moves a scheduler makes in serving/decode/cache.py's `TreeStaticCache`: empty or shorten
a row, swap two rows, move one into another, and the per-row tensors that move with the cache's
rows (`follow`: a drafter's state, the decode step's). Every move touches the cache's one KV
buffer and each follower once, and sets the rows' lengths on the host and on the device."""

from __future__ import annotations

import torch


class CacheRows:
    """Mixed into `TreeStaticCache`, whose `lengths` (host and device lengths), `storage` (the one
    KV buffer [L, 2, B, kv_heads, M, D]), `followers`, `capacity` and `max_cache_len` it reads."""

    def reset_row(self, row: int) -> None:
        """Empty one row (a new sequence takes it); its buffers are not cleared (dead data is masked)."""
        self.truncate_row(row, 0)

    def truncate_row(self, row: int, length: int) -> None:
        """Keep the first `length` committed positions of one row (a sequence that continues
        another's context); later entries become dead data."""
        if not 0 <= length <= self.lengths.host[row]:
            raise ValueError(f"row {row} holds {self.lengths.host[row]} positions; cannot keep {length}")
        self._set_length(row, length)

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange the sequences of rows a and b (a scheduler reorders its batch), followers too."""
        length = max(self.lengths.host[a], self.lengths.host[b])
        for buffer, dim in self._row_buffers():
            row_a, row_b = self._row(buffer, dim, a, length), self._row(buffer, dim, b, length)
            saved = row_a.clone()
            row_a.copy_(row_b)
            row_b.copy_(saved)
        length_a, length_b = self.lengths.host[a], self.lengths.host[b]
        self._set_length(a, length_b)
        self._set_length(b, length_a)

    def move_row(self, src: int, dst: int) -> None:
        """Move sequence src into row dst (dst's sequence is dropped), followers too: keeps the
        active rows contiguous when a sequence leaves a batch."""
        length = self.lengths.host[src]
        for buffer, dim in self._row_buffers():
            self._row(buffer, dim, dst, length).copy_(self._row(buffer, dim, src, length))
        self._set_length(dst, length)
        self._set_length(src, 0)

    def follow(self, buffer: torch.Tensor, dim: int = 2) -> None:
        """Move the rows (index `dim` = this cache's rows) of another per-row tensor with this
        cache's (swap_rows, move_row): a drafter's or the decode step's per-row state. A 6-d
        follower with dim 2 is KV-like, [L', 2, B, H', >= max_cache_len, D'] (an EAGLE head's
        cache, serving/decode/eagle.py), and moves only the positions its row commits."""
        if buffer.shape[dim] != self.capacity:
            raise ValueError(f"a follower needs {self.capacity} rows on dim {dim}, got {tuple(buffer.shape)}")
        if buffer.dim() == 6 and dim == 2 and buffer.shape[4] < self.max_cache_len:
            raise ValueError(f"a KV-like follower must be [L, 2, {self.capacity}, H, >= {self.max_cache_len}, D], "
                             f"got {tuple(buffer.shape)}")
        self.followers.append((buffer, dim))

    def _row_buffers(self) -> list[tuple[torch.Tensor, int]]:
        return ([] if self.storage.buffer is None else [(self.storage.buffer, 2)]) + self.followers

    @staticmethod
    def _row(buffer: torch.Tensor, dim: int, row: int, length: int) -> torch.Tensor:
        """Row `row` of a row buffer: its first `length` positions where it is KV-like."""
        if buffer.dim() == 6 and dim == 2:
            return buffer[:, :, row, :, :length]
        return buffer.select(dim, row)

    def _set_length(self, row: int, length: int) -> None:
        """One row's committed length, on the host and on the device (a fill with a scalar
        argument: no copy from host memory; a captured graph that reads device_lens sees it)."""
        self.lengths.num_pending = 0
        self.lengths.host[row] = length
        self.lengths.device_lens[row].fill_(length)
