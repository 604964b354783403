"""The live display of `solar-host pull`: a progress bar on a terminal, a line per 10% otherwise.

The host reports a running pull's bytes (and size, where the source announces it) through
GET /metrics every PULL_PROGRESS_INTERVAL_S; the command polls that while its POST waits.
On a terminal, rich draws the bar with size, rate and ETA; when stdout is a pipe or a file,
one plain line per 10% (or per phase, when the size is unknown) keeps logs readable.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from solar_host.cli.format import human_bytes, human_duration, visible


def read_pull_progress(metrics_text: str, uri: str) -> tuple[str | None, int | None, int | None]:
    """(phase, bytes_done, bytes_total) of the running pull of `uri`, from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    phase = done = total = None
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.labels.get("source_uri") != uri:
                continue
            if s.name == "solar_host_model_pull_progress_bytes":
                phase, done = s.labels.get("phase"), int(s.value)
            elif s.name == "solar_host_model_pull_expected_bytes":
                total = int(s.value)
    return phase, done, total


class RateMeter:
    """Average download rate since the first byte was reported (bytes/s), and the ETA."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None
        self.rate: float | None = None

    def sample(self, done: int, now: float) -> None:
        if self.first is None:
            self.first = (now, done)
            return
        t0, b0 = self.first
        if now > t0 and done > b0:
            self.rate = (done - b0) / (now - t0)

    def eta(self, done: int, total: int | None) -> float | None:
        if not total or not self.rate:
            return None
        return max(0.0, (total - done) / self.rate)


class PlainPullLines:
    """One line per 10% of a known size, else one per phase: for pipes, files and CI logs."""

    def __init__(self, uri: str, stream: TextIO):
        self.uri = uri
        self.stream = stream
        self.meter = RateMeter()
        self.decile = -1
        self.phase: str | None = None
        self.total: int | None = None

    def update(self, phase: str | None, done: int | None, total: int | None) -> None:
        now = time.monotonic()
        if done is not None:
            self.meter.sample(done, now)
        if total:
            self.total = total
        if total and done is not None:
            decile = min(10, done * 10 // total)
            if decile > self.decile:
                self.decile = decile
                self._line(done, total)
            return
        if phase and phase != self.phase:
            self.phase = phase
            size = f"  {human_bytes(done)}" if done else ""
            print(f"{self.uri}: {visible(phase)}{size}", file=self.stream, flush=True)

    def _line(self, done: int, total: int) -> None:
        parts = [f"{self.uri}: {done / total:4.0%}", f"{human_bytes(done)} / {human_bytes(total)}"]
        if self.meter.rate:
            parts.append(f"{human_bytes(self.meter.rate)}/s")
        eta = self.meter.eta(done, total)
        if eta is not None and done < total:
            parts.append(f"ETA {human_duration(eta)}")
        print("  ".join(parts), file=self.stream, flush=True)

    def close(self, ok: bool) -> None:
        # The pull leaves /metrics when it ends, usually before a last sample showed 100%.
        if ok and self.total and self.decile < 10:
            self.meter.sample(self.total, time.monotonic())
            self.decile = 10
            self._line(self.total, self.total)


class PullBar:
    """rich's progress bar: phase, bar, bytes done / size, rate, ETA (drawn on a terminal)."""

    def __init__(self, uri: str, stream: TextIO):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        # Not markup: the URI and the phase (from the host's /metrics) are shown as they are.
        self.progress = Progress(
            TextColumn("{task.description}", markup=False, style="bold"),
            TextColumn("{task.fields[phase]}", markup=False),
            BarColumn(),
            DownloadColumn(binary_units=True),
            _binary_speed_column(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self.task = self.progress.add_task(f"pulling {uri}", total=None, phase="starting")
        self.progress.start()

    def update(self, phase: str | None, done: int | None, total: int | None) -> None:
        fields: dict[str, Any] = {"phase": visible(phase)}
        if total:
            fields["total"] = total
        if done is not None:
            fields["completed"] = done
        self.progress.update(self.task, **fields)

    def close(self, ok: bool) -> None:
        if ok:
            task = self.progress.tasks[0]
            if task.total:
                self.progress.update(self.task, completed=task.total, phase="completed")
            else:
                self.progress.update(self.task, phase="completed")
        self.progress.stop()


def _binary_speed_column() -> Any:
    """rich's rate column in KiB/s and MiB/s, the units of the size beside it."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinarySpeedColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?/s" if speed is None else f"{human_bytes(speed)}/s")

    return BinarySpeedColumn()


def pull_display(uri: str, stream: TextIO) -> PullBar | PlainPullLines:
    """The bar on a terminal, plain lines elsewhere."""
    return PullBar(uri, stream) if stream.isatty() else PlainPullLines(uri, stream)
