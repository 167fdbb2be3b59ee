"""What the running fleet tells people: each storyline step, fault and restored worker, with its time.

Every line goes to standard output (``sim.log`` under the demo) with a timestamp, and, with
``--announce FILE``, to that file as one JSON object a line (``{"ts": <unix s>, "text": ...}``),
which the console shows in its banner (``PREFIXSCOPE_CONSOLE_ANNOUNCE``). The file is rewritten to
its newest ``KEEP`` lines once it doubles, so it stays small however long the demo runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

KEEP = 200


def stamp(ts: float) -> str:
    """``2024-05-01 14:03:27`` in this host's zone: how a log line starts."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class Announcer:
    def __init__(self, path: Path | None = None, out: TextIO | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.out = out
        self.clock = clock
        self._lines = 0

    def say(self, text: str, announce: bool = True) -> None:
        """A timestamped line on stdout; with ``announce``, also in the announcements file."""
        ts = self.clock()
        print(f"{stamp(ts)} {text}", file=self.out or sys.stdout, flush=True)
        if announce and self.path is not None:
            self._append(json.dumps({"ts": ts, "text": text}))

    def _append(self, line: str) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
                f.write(line + "\n")
            self._lines += 1
            if self._lines >= 2 * KEEP:
                self._trim()
        except OSError as exc:  # announcing is a courtesy: the fleet carries on without it
            print(f"{stamp(self.clock())} announcements file {self.path}: {exc}", file=sys.stderr, flush=True)

    def _trim(self) -> None:
        assert self.path is not None
        lines = self.path.read_text(encoding="utf-8").splitlines()[-KEEP:]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        self._lines = len(lines)
