"""The progress helper (sapd.progress): counts and ETA; in a log one plain line per interval, also while a
single item takes longer than the interval, and never a carriage return; a redrawn status line on a
terminal."""

from __future__ import annotations

import io
import time

from sapd.progress import Progress, duration


def wait_for(condition, seconds: float = 10.0) -> None:
    """Poll (the heartbeat is a thread: on a busy machine it may run late, never early)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_lines_mode_prints_counts_eta_and_a_line_while_one_item_is_slow():
    lines: list[str] = []
    progress = Progress(lines.append, mode="lines", every=0.2)
    with progress.task("round 0 sampling", total=4, unit="prefix") as bar:
        bar.update(1)
        wait_for(lambda: len(lines) >= 2)  # one slow item: the heartbeat prints while nothing is updated
        bar.update(3)
    assert all("\r" not in line and "\n" not in line for line in lines)
    assert lines[0].startswith("round 0 sampling: 1/4 prefixes (25%), 0:00 elapsed, ETA ")
    assert lines[-1].startswith("round 0 sampling: 4/4 prefixes (100%)") and lines[-1].endswith(" in all")


def test_nested_tasks_share_one_line_per_interval():
    lines: list[str] = []
    progress = Progress(lines.append, mode="lines", every=0.15)
    with progress.task("run", total=3, unit="step", initial=1) as run:
        with progress.task("round 1 training", total=2, unit="step") as steps:
            steps.update()
            wait_for(lambda: len(lines) >= 2)
        run.update()
    both = [line for line in lines if " | " in line]
    assert len(both) == len(lines) - 2  # one line per interval with both tasks, not one per task
    assert both[0].startswith("run: 1/3 steps (33%), ") and " | round 1 training: 1/2 steps (50%), " in both[0]
    assert lines[-2].startswith("round 1 training: 1/2 steps (50%)") and lines[-2].endswith(" in all")
    assert lines[-1].startswith("run: 2/3 steps (67%)")


def test_short_work_prints_nothing_and_off_prints_nothing():
    lines: list[str] = []
    with Progress(lines.append, mode="lines", every=30).task("quick", total=3) as bar:
        bar(3)
    with Progress(lines.append, mode="off", every=0.01).task("quiet", total=3) as bar:
        time.sleep(0.05)
        bar(3)
    assert lines == []


def test_without_a_total_it_counts_and_gives_a_rate():
    lines: list[str] = []
    progress = Progress(lines.append, mode="lines", every=0.05)
    task = progress.task("evaluating checkpoint 2", unit="step", initial=0)
    task.update(5)
    wait_for(lambda: lines)
    task.close()
    assert any(line.startswith("evaluating checkpoint 2: 5 steps, ") and "/s" in line or "per step" in line
               for line in lines), lines


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_mode_redraws_one_line_and_keeps_log_lines_above_it(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    term = FakeTerminal()
    logged: list[str] = []
    progress = Progress(logged.append, stream=term)  # auto: a terminal → the bar
    assert progress.mode == "bar"
    with progress.task("run", total=9, unit="step", initial=2) as outer, progress.task("round 1 training", total=4,
                                                                                        unit="step") as inner:
        inner.update(1)
        time.sleep(0.11)
        inner.update(1)
        progress.log("round 1 step 2: loss 0.5")
        outer.update(1)
    out = term.getvalue()
    assert out.count("\r") >= 3 and "\n" not in out
    assert "run: 2/9 steps (22%)" in out and " | round 1 training: 2/4 steps (50%)" in out
    assert logged == ["round 1 step 2: loss 0.5"]
    assert out.endswith("\r")  # cleared when the last task closed


def test_duration():
    assert [duration(s) for s in (0, 59.6, 61, 3600)] == ["0:00", "1:00", "1:01", "1:00:00"]
