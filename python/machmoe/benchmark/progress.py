"""Progress display: a rich (else tqdm) bar on a terminal; plain timestamped lines on stderr otherwise.

A bar redrawn in place is useless in a batch log (a GPU job whose output goes to a file, possibly cut off by a time
limit): there each unit of work gets its own flushed line with the time since the start and the time the previous
unit took, so a log of a run that was stopped still says what ran and for how long."""
import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, interactive=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self._rich = self._tqdm = None
        self._stream = stream if stream is not None else sys.stderr
        self._start = self._last = time.monotonic()
        self._what = ""
        self.backend = "off"
        if not enabled:
            return
        if interactive is None:
            interactive = bool(getattr(self._stream, "isatty", lambda: False)())
        if not interactive:
            self.backend = "plain"
            return
        try:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                                      "{task.total}"), TimeElapsedColumn(), transient=False)
            self._rich.start()
            self._task = self._rich.add_task("machmoe.benchmark", total=total)
            self.backend = "rich"
            return
        except ImportError:
            pass
        try:
            from tqdm import tqdm
            self._tqdm = tqdm(total=total, desc="machmoe.benchmark", file=self._stream)
            self.backend = "tqdm"
            return
        except ImportError:
            self.backend = "plain"

    def step(self, what: str) -> None:
        """Announces the next unit of work (and counts the previous one as done)."""
        if not self.enabled:
            return
        if self.done:
            self._advance()
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, description=what)
        elif self._tqdm is not None:
            self._tqdm.set_description_str(what)
        else:
            now = time.monotonic()
            took = f"; previous step {now - self._last:.1f} s" if self.done > 1 else ""
            print(f"[{self.done}/{self.total} +{now - self._start:.0f} s] {what}{took}", file=self._stream,
                  flush=True)
            self._last = now
        self._what = what

    def _advance(self):
        if self._rich is not None:
            self._rich.advance(self._task)
        elif self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.done:
            self._advance()
        if self._rich is not None:
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.close()
        elif self.done:
            now = time.monotonic()
            print(f"[done +{now - self._start:.0f} s] {self._what} took {now - self._last:.1f} s", file=self._stream,
                  flush=True)
