"""When to try again: the pause between a start's attempts, and the crash-restart policy.

Pure: the clock is passed in, so every rule is testable without waiting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from solar_host.settings import Settings


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    window_s: float  # RESTART_WINDOW_S: crashes older than this are forgiven
    max_in_window: int  # RESTART_MAX_IN_WINDOW: at this many, the host gives up
    backoff_s: float  # RESTART_BACKOFF_S: the first pause, doubled at each crash or attempt
    backoff_max_s: float  # RESTART_BACKOFF_MAX_S

    @classmethod
    def of(cls, settings: Settings) -> RestartPolicy:
        return cls(
            settings.restart_window_s,
            settings.restart_max_in_window,
            settings.restart_backoff_s,
            settings.restart_backoff_max_s,
        )

    def attempt_pause(self, attempt: int, remaining_s: float) -> float:
        """The pause after failed attempt `attempt` (0-based) of a start, within what is left
        of its deadline: what failed often clears in a moment (a port or GPU memory the
        crashed process still held), so the pause doubles from RESTART_BACKOFF_S."""
        return min(self.backoff_s * 2**attempt, self.backoff_max_s, max(remaining_s, 0.0))


@dataclass(frozen=True, slots=True)
class CrashVerdict:
    crashes: int  # within the window, this one included
    delay_s: float | None  # None: crash loop, the host gives up


class CrashLoop:
    """The crashes of one instance within the window (supervisord's startretries, with a
    window and a backoff): each crash says whether to restart, and after how long."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()

    def clear(self) -> None:
        """Someone asked for a start: the loop before it is over (as supervisord's start)."""
        self._times.clear()

    def crashed(self, now: float) -> CrashVerdict:
        self._times.append(now)
        while self._times and now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        n = len(self._times)
        if n >= self.policy.max_in_window:
            return CrashVerdict(n, None)
        delay = min(self.policy.backoff_s * (2 ** (n - 1)), self.policy.backoff_max_s)
        return CrashVerdict(n, delay)
