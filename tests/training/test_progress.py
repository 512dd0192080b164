"""Training progress (training/progress.py, training/tracking.py): the figures from a fake clock,
the plain lines off a terminal, the bar on one, and W&B getting the same figures."""

from __future__ import annotations

import io

import pytest

from specheads.training.progress import Progress
from specheads.training.tracking import Tracker, WandbTracker, format_duration, format_metrics, step_metrics


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def resumed_at_10_of_30(stream=None, clock=None) -> Progress:
    """A run resumed at step 10 of 30 on 2 ranks: 5 steps of 2 s and 100 loss tokens each."""
    clock = clock or FakeClock()
    progress = Progress(10, 30, world_size=2, stream=stream or io.StringIO(), clock=clock)
    for step in range(5):
        clock.now += 2.0
        progress.step(100, loss=1.5 + step)
    return progress


def test_figures_are_loss_tokens_over_all_ranks_per_second_and_the_steps_left_at_the_mean_pace():
    clock = FakeClock()
    progress = resumed_at_10_of_30(clock=clock)
    assert progress.figures() == {"train/loss_tokens_per_s": pytest.approx(500 * 2 / 10.0),
                                  "train/eta_s": pytest.approx(15 * 2.0)}
    clock.now += 8.0  # a slower step (an eval, a checkpoint) since the last line
    progress.step(40)
    figures = progress.figures()  # the rate restarts at each line; the pace is since the start
    assert figures["train/loss_tokens_per_s"] == pytest.approx(40 * 2 / 8.0)
    assert figures["train/eta_s"] == pytest.approx(14 * 18.0 / 6)


def test_off_a_terminal_there_is_no_bar_and_the_lines_carry_loss_tok_s_and_the_eta(capsys):
    stderr = io.StringIO()
    progress = resumed_at_10_of_30(stream=stderr)
    assert progress.bar is None
    tracker = Tracker(30, write=progress.write)
    tracker.log(15, step_metrics([2.0, 3.0], [0.5, 0.25], 1e-3, progress.figures()))
    progress.close()
    assert capsys.readouterr().out == ("step 15/30 loss 2.5000 | head loss 2.000 3.000 | top1 0.500 0.250 | "
                                       "lr 1.00e-03 | 100 loss tok/s | ETA 0:00:30\n")
    assert stderr.getvalue() == ""


def test_on_a_terminal_a_bar_shows_the_step_loss_and_loss_tok_s_and_the_lines_go_above_it(capsys):
    terminal = Terminal()
    progress = resumed_at_10_of_30(stream=terminal)
    assert progress.bar is not None
    progress.bar.refresh()
    shown = terminal.getvalue()
    assert "15/30" in shown and "loss 5.5000" in shown and "100 loss tok/s" in shown
    progress.write("eval step 15/30 | top1 0.500 | chain tau est 1.500")
    progress.close()
    assert capsys.readouterr().out == "eval step 15/30 | top1 0.500 | chain tau est 1.500\n"


def test_other_ranks_show_no_bar_and_write_nothing(capsys):
    progress = Progress(0, 10, world_size=2, show=False, stream=Terminal())
    progress.write("specheads train: SIGTERM: stopping after step 3")
    assert progress.bar is None and capsys.readouterr().out == ""


def test_durations_read_as_hours_minutes_seconds():
    assert [format_duration(s) for s in (0, 59.6, 3723.4, 26 * 3600)] == ["0:00:00", "0:01:00", "1:02:03",
                                                                          "26:00:00"]


def test_w_and_b_gets_the_figures_of_the_line():
    logged = []

    class Run:
        def log(self, metrics, step):
            logged.append((step, metrics))

    lines = []
    tracker = WandbTracker.__new__(WandbTracker)  # no wandb.init: the run is the fake above
    Tracker.__init__(tracker, 30, write=lines.append)
    tracker.run = Run()
    metrics = step_metrics([2.0], [0.5], 1e-3, {"train/loss_tokens_per_s": 640.0, "train/eta_s": 75.0})
    tracker.log(7, metrics)
    assert logged == [(7, metrics)] and lines == [format_metrics(7, 30, metrics)]
    assert metrics["train/loss_tokens_per_s"] == 640.0 and "640 loss tok/s | ETA 0:01:15" in lines[0]
