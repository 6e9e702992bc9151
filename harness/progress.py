"""Progress on rank 0 across all ranks: a tqdm bar on a terminal, a line every few seconds in a log."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """events done / total, phase, elapsed and ETA; `advance` may be fed by any rank's reports."""

    def __init__(self, phase: str, total: int, enabled: bool = True, log_every_s: float = 5.0, unit: str = "event"):
        self.phase, self.total, self.done, self.unit = phase, total, 0, unit
        self.enabled = enabled and total > 0
        self.start = time.monotonic()
        self.log_every_s = log_every_s
        self._last_log = self.start  # a log line every log_every_s, the first after that long
        self._bar = None
        if self.enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, desc=phase, unit=unit, file=sys.stderr, mininterval=0.5,
                             dynamic_ncols=True)

    def advance(self, count: int = 1) -> None:
        """Count `count` more done; past the total (sampling to a precision beyond the repeats) the total grows."""
        self.done += count
        grew = self.done > self.total
        self.total = max(self.total, self.done)
        if not self.enabled:
            return
        if self._bar is not None:
            if grew:
                self._bar.total = self.total
            self._bar.update(count)
            return
        now = time.monotonic()
        long_run = now - self.start >= self.log_every_s  # a short phase ends without a line
        if now - self._last_log >= self.log_every_s or (self.done >= self.total and long_run):
            self._last_log = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = f"[{self.phase}] {self.done}/{self.total} {self.unit}s, elapsed {elapsed:.1f} s"
        if self.done < self.total and rate > 0:
            line += f", ETA {(self.total - self.done) / rate:.1f} s"
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done < self.total and time.monotonic() - self.start >= self.log_every_s:
            print(self.line(), file=sys.stderr, flush=True)
