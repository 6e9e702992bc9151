"""Progress on rank 0 across all ranks: one tqdm bar on a terminal (its total may grow), and in a log (a Slurm
job's, `make demo > log`) a line per phase at most every LOG_EVERY_S seconds, none for a phase shorter than that."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOG_EVERY_S = 10.0


class Progress:
    """events done / total, phase, elapsed and ETA; `advance` may be fed by any rank's reports."""

    def __init__(self, phase: str, total: int, enabled: bool = True, log_every_s: float = LOG_EVERY_S,
                 unit: str = "event"):
        self.phase, self.total, self.done, self.unit = phase, total, 0, unit
        self.enabled = enabled and total > 0
        self.start = time.monotonic()
        self.log_every_s = log_every_s
        self._last_log = self.start  # a log line at most every log_every_s, the first after that long
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
        self._log_if_due()

    def _log_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
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
        elif self.enabled:
            self._log_if_due()  # the phase's last count, if no line said it in the last log_every_s
