"""The state file: what the exporter keeps across a restart (config ``state_file``; off by default).

An exporter that restarts rebuilds its prefix index from the workers' KV events, but the history
behind ``/api/v1/changes`` (hit and new-session events of the last hour, pool changes) and the
names of prefixes (their first tokens and the texts workers detokenized) would start empty: "what
changed" would forget the incident it is asked about. So the newest of each is written, bounded
(``Hotspots.saved``: at most 20 000 hit events over 4 096 distinct chains; the name tables' own
caps), every ``state_interval`` and once at shutdown, to a temporary file renamed over the last
one; it is read once at start, before any input. A file that is missing starts empty; one that
cannot be read, is not this format or is larger than ``MAX_FILE_BYTES`` is logged once and
ignored (its malformed entries are counted and left out).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from exporter.core.prefix_text import PrefixNames
from exporter.core.state import ClusterState
from exporter.core.worker_pool import PoolChange
from exporter.loops.periodic import Periodic

log = logging.getLogger("prefixscope.state_file")

FORMAT = "prefixscope-state/1"
MAX_FILE_BYTES = 64 * 1024 * 1024  # far above what the bounded parts write (a few MB)


class StateFile:
    """``load()`` once at start; ``start()`` writes every ``interval``; ``close()`` writes once more."""

    def __init__(self, path: Path, state: ClusterState, names: PrefixNames | None = None,
                 interval: float = 60.0) -> None:
        self.path = path
        self.state = state
        self.names = names
        self.interval = interval
        self._loop = Periodic("state file", interval, self._save_quietly, log, "the previous file stays")
        self._first = True  # the loop's first step runs at start: nothing new to write yet

    # ---- reading ----------------------------------------------------------------------------
    def load(self) -> bool:
        """Restore what the file holds; False when there is none or it is unusable (logged)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("state file %s not read: %s", self.path, exc)
            return False
        if size > MAX_FILE_BYTES:
            log.warning("state file %s not read: %d bytes, more than %d", self.path, size, MAX_FILE_BYTES)
            return False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("state file %s not read: %s", self.path, exc)
            return False
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            log.warning("state file %s not read: not a %s file", self.path, FORMAT)
            return False
        bad = self.restore(data)
        if bad:
            log.warning("state file %s: %d malformed entries left out", self.path, bad)
        log.info("state file %s read: the history of /api/v1/changes and prefix names restored", self.path)
        return True

    def restore(self, data: dict[str, Any]) -> int:
        """Put the parts back (under the state's lock); returns how many entries were malformed."""
        names = self.names

        def put(st: ClusterState) -> int:
            history = data.get("history")
            bad = st.hotspots.restore(history if isinstance(history, dict) else {}, st.clock())
            return bad + _restore_pool_changes(st, data.get("pool_changes"))

        bad = self.state.snapshot_for(put)
        if names is not None:
            bad += names.tokens.restore(data.get("prefix_tokens"))
            bad += names.detokenizer.restore(data.get("prefix_texts"))
        return bad

    # ---- writing ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        def take(st: ClusterState) -> dict[str, Any]:
            return {"history": st.hotspots.saved(),
                    "pool_changes": [[c.ts, c.before, c.after, c.seen_both, c.moved] for c in st.worker_pool.changes]}

        out: dict[str, Any] = {"format": FORMAT, **self.state.snapshot_for(take)}
        if self.names is not None:
            out["prefix_tokens"] = self.names.tokens.saved()
            out["prefix_texts"] = self.names.detokenizer.saved()
        return out

    def save(self) -> None:
        """Write the file: a temporary file beside it, renamed over it (a reader never sees half)."""
        body = json.dumps(self.snapshot(), separators=(",", ":"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _save_quietly(self) -> None:
        if self._first:
            self._first = False
            return
        self.save()

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> StateFile:
        log.info("state file %s written every %gs and at shutdown", self.path, self.interval)
        self._loop.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and write the file a last time."""
        self._loop.close(timeout)
        try:
            self.save()
        except OSError as exc:
            log.warning("state file %s not written at shutdown: %s", self.path, exc)


def _restore_pool_changes(st: ClusterState, raw: object) -> int:
    """Saved pool changes in front of this process's own (their epochs are the old process's: 0)."""
    bad, found = 0, []
    for row in raw if isinstance(raw, list) else ():
        if (isinstance(row, list) and len(row) == 5 and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                              for v in row)):
            found.append(PoolChange(float(row[0]), int(row[1]), int(row[2]), 0, int(row[3]), int(row[4])))
        else:
            bad += 1
    changes = st.worker_pool.changes
    mine = list(changes)
    changes.clear()
    changes.extend([*found, *mine])
    return bad
