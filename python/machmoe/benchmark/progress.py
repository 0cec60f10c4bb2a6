"""Progress display: rich if importable, else tqdm, else plain lines on stderr."""
import sys


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._rich = self._tqdm = None
        if not enabled:
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
            self._tqdm = tqdm(total=total, desc="machmoe.benchmark", file=sys.stderr)
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
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

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
