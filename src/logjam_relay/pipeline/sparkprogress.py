"""Progress of ``pipeline stats`` on a terminal: the Spark stages that run (tasks done of
all), polled from Spark's status tracker by a thread, else the command's last log line.
Nothing is drawn before the session is up: the JVM writes its start-up lines to the same
terminal.

Nothing is drawn when standard error is not a terminal (:class:`..progress.Progress`), and
then no thread is started either.  Spark's own console progress bar is turned off by the
command in every case (``spark.ui.showConsoleProgress=false``): it wrote its bar to
standard error even when that was a pipe or a file.
"""

from __future__ import annotations

import threading

from ..progress import Progress


class SparkProgress:
    def __init__(self, label: str = "pipeline stats", stream=None, poll_s: float = 0.25):
        self.progress = Progress(label, stream=stream)
        self.enabled = self.progress.enabled
        self.poll_s = poll_s
        self.step = ""
        self._sc = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def log(self, msg: str) -> None:
        """Print a log line (stdout) without mixing it with the progress line, and make it
        the step shown."""
        self.progress.print(msg)
        self.step = msg.split("] ", 1)[-1].strip()
        if self._thread is not None:
            self.progress.update(note=self.step)

    def attach(self, sc) -> None:
        """Start polling the stages of a SparkContext."""
        if not self.enabled or self._thread is not None:
            return
        self._sc = sc
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def _stages(self) -> str:
        st = self._sc.statusTracker()
        parts = []
        for sid in sorted(st.getActiveStageIds()):
            info = st.getStageInfo(sid)
            if info is not None:
                parts.append(f"stage {sid}: {info.numCompletedTasks}/{info.numTasks} tasks")
        return ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                stages = self._stages()
            except Exception:       # the context is stopping: keep the last line
                stages = ""
            self.progress.update(note=stages or self.step)

    def stop(self) -> None:
        """Stop polling (before the SparkContext stops)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self.progress.close()
