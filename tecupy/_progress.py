"""A small honest progress bar for long work: done/total, elapsed, and the time left
extrapolated from the steps done so far. Redrawn in place on a terminal; on a pipe (CI, a
notebook's captured output) a line per tenth of the work (and the first step), so logs show
that work goes on without a line per item."""
import sys
import time


class Progress:
    def __init__(self, total, unit, show=True, stream=None, width=24):
        self.total, self.unit, self.show, self.width = int(total), unit, show, width
        self.stream = stream or sys.stderr
        self.done, self.t0 = 0, time.perf_counter()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.show and self._tty():
            self.stream.write("\n")
            self.stream.flush()
        return False

    def _tty(self):
        return getattr(self.stream, "isatty", lambda: False)()

    def line(self):
        elapsed = time.perf_counter() - self.t0
        fill = self.width * self.done // max(self.total, 1)
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} "
                f"{self.unit}, {elapsed:.1f} s, about {left:.0f} s left")

    def advance(self, n=1):
        self.done += n
        if not self.show:
            return
        if self._tty():
            self.stream.write("\r" + self.line())
        elif self.done == 1 or 10 * self.done // self.total != 10 * (self.done - n) // self.total:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
