"""The scenario matrix's rows, computed once per session on both cores.

For the steady-state rows, presets that run the same fleet up to their fault (after the long
warm-up) form a family (lab.family): its shared start runs once, and each preset continues from a
fork of it. Presets that probably share their start
(tests.e2e.harness.share_hint) go to the same worker, the most work first so that both workers
stay busy to the end; the worker groups them exactly.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from fleet.scenarios import load_preset
from tests.e2e.harness import Row, run_row, run_steady_rows, share_hint
from tests.support import require_tool

WORKERS = 2  # CI's machine has two cores
# A safety net against a hung row, not a budget: one row takes 10–40 s on an idle 2-core machine
# and several times that on a loaded one. The fixture's wait grows with the rows it computes.
ROW_SAFETY_NET_S = 300.0


def _groups(names: Sequence[str]) -> list[list[str]]:
    """``names`` grouped by :func:`share_hint`, the most work first; a preset that does not load is
    a group of its own (its run then says what is wrong).

    A group's work is guessed from the chat sessions it routes: its healthy start once, then
    each member's fault phase, at its chat session rate (``worker-failures``, at 2.4 sessions/s,
    is a fifth of all the work: started last, it would leave one worker idle for a minute).
    """
    groups: dict[Hashable, list[str]] = {}
    work: dict[Hashable, float] = {}
    for n in names:
        try:
            sc = load_preset(n)
            key: Hashable = share_hint(sc)
        except Exception:
            groups[("alone", n)], work[("alone", n)] = [n], 0.0
            continue
        rate = sc.workload.chat_sessions_per_s
        work[key] = work.get(key, sc.fault_at_s * rate) + (sc.duration_s - sc.fault_at_s) * rate
        groups.setdefault(key, []).append(n)
    return [groups[k] for k in sorted(groups, key=lambda k: work[k], reverse=True)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The session fixture below replays every scenario once, inside the setup of whichever matrix
    # test runs first; pytest-timeout would charge all of it to that one test. Time only the test
    # bodies; the fixture has its own limit, proportional to its work.
    for item in items:
        if "matrix_rows" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(func_only=True))


@pytest.fixture(scope="session")
def matrix_rows(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row | BaseException]:
    """Every scenario the selected tests ask for, replayed and evaluated in worker processes."""
    require_tool("promtool")
    names = sorted({item.callspec.params["scenario"] for item in request.session.items
                    if "matrix_rows" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})
    dirs = {n: tmp_path_factory.mktemp(n) for n in names}
    deadline = time.monotonic() + ROW_SAFETY_NET_S * max(1, len(names))
    # fork would copy the test runner's threads' locks; spawn starts clean interpreters
    pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))
    rows: dict[str, Row | BaseException] = {}
    try:
        # one task per preset: their shared first 300 s is too small a part to be worth a family
        futures = {n: pool.submit(run_row, n, dirs[n]) for n in names}
        for n, f in futures.items():
            try:
                rows[n] = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # one broken scenario fails its own tests, not the matrix
                rows[n] = exc
    finally:
        if any(isinstance(r, FutureTimeout) for r in rows.values()):
            for proc in list(getattr(pool, "_processes", {}).values()):  # a hung row: stop it
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    return rows


@pytest.fixture(scope="session")
def steady_rows(request: pytest.FixtureRequest) -> dict[str, dict | BaseException]:
    """Every scenario the selected steady-state tests ask for, after the warm-up, in worker processes."""
    names = sorted({item.callspec.params["scenario"] for item in request.session.items
                    if "steady_rows" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})
    with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {tuple(g): pool.submit(run_steady_rows, g) for g in _groups(names)}
        rows: dict[str, dict | BaseException] = {}
        for fam, f in futures.items():
            try:
                rows.update(f.result())
            except Exception as exc:  # one broken group fails its own tests, not the matrix
                rows.update(dict.fromkeys(fam, exc))
    return rows
