"""Training progress a person can read: a tqdm bar on a terminal, plain lines otherwise.

On a terminal (rank 0's stderr is a TTY) a bar on stderr moves every step and shows the step,
that step's loss (rank 0's), loss tok/s and the ETA; the metric lines (every train.log_every
steps, and every held-out eval) are printed on stdout above it. Anywhere else (a log file, a
pipe, CI) there is no bar, only the lines. The lines and W&B (training/tracking.py) get the
same figures:

    train/loss_tokens_per_s  tokens that carry loss (loss mask), counted on this rank x world
                             size, per second over the steps since the last line
    train/eta_s              the steps left x the mean seconds a step took since this process
                             started stepping (a resumed run: since the resume); evals and
                             checkpoints count, the calibration after the last step does not
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Rank 0's progress over steps start_step+1..total_steps (other ranks: show=False)."""

    def __init__(self, start_step: int, total_steps: int, world_size: int, show: bool = True,
                 stream: TextIO | None = None, clock=time.perf_counter):
        stream = stream if stream is not None else sys.stderr
        self.start_step, self.total_steps, self.world_size, self.clock = start_step, total_steps, world_size, clock
        self.started = self.window_start = clock()
        self.window_tokens, self.step_count = 0, 0
        self.show, self.bar = show, None
        if show and stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step", file=stream,
                            dynamic_ncols=True, leave=True)

    def step(self, num_tokens: int, loss=None) -> None:
        """One step done: its loss tokens (this rank's) and, for the bar, its loss (a float or a
        0-d tensor, read only when there is a bar: no device sync per step otherwise)."""
        self.window_tokens += num_tokens
        self.step_count += 1
        if self.bar is not None:
            rate = self._rate(self.clock())
            self.bar.set_postfix_str(f"loss {float(loss):.4f}, {rate:.0f} loss tok/s", refresh=False)
            self.bar.update(1)

    def figures(self) -> dict[str, float]:
        """loss tok/s since the last call and the ETA, as logged (module docstring)."""
        now = self.clock()
        figures = {"train/loss_tokens_per_s": self._rate(now), "train/eta_s": self._eta(now)}
        self.window_start, self.window_tokens = now, 0
        return figures

    def write(self, line: str) -> None:
        """A line on stdout (rank 0's), above the bar when there is one."""
        if not self.show:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _rate(self, now: float) -> float:
        return self.window_tokens * self.world_size / max(now - self.window_start, 1e-9)

    def _eta(self, now: float) -> float:
        done = self.start_step + self.step_count
        return (self.total_steps - done) * (now - self.started) / max(self.step_count, 1)
