"""One background thread that runs a step every ``interval`` seconds (the first right away).

A step that raises is an exporter bug, not bad input: it is logged once per run of failures and
the thread keeps going. ``close()`` lets a step in progress finish, bounded by its timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Periodic:
    def __init__(self, name: str, interval: float, step: Callable[[], object], log: logging.Logger,
                 on_failure: str) -> None:
        if interval <= 0:
            raise ValueError(f"{name} interval must be > 0, got {interval}")
        self.name = name
        self.interval = interval
        self._step = step
        self._log = log
        self._on_failure = on_failure  # what a failed step leaves in place, for the log line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._run, name=f"prefixscope-{self.name.replace(' ', '-')}",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._log.warning("%s did not stop within %.1fs", self.name, timeout)

    def _run(self) -> None:
        failed = False
        while True:
            try:
                self._step()
                failed = False
            except Exception:
                if not failed:
                    self._log.exception("%s failed; %s", self.name, self._on_failure)
                failed = True
            if self._stop.wait(self.interval):
                return


class PeriodicJob:
    """A part that runs its work on a :class:`Periodic` (``self._loop``): whether it runs, and its
    stop, said once for every such part."""

    _loop: Periodic

    @property
    def running(self) -> bool:
        return self._loop.running

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; a step in progress finishes first (bounded by ``timeout``)."""
        self._loop.close(timeout)
