"""The scenario matrix's rows, computed once per session on both cores.

Presets that run the same fleet up to their fault form a family (lab.family): its shared start
runs once, and each preset continues from a fork of it. The families are found first (each
preset's key, in the workers), then each family is one task; the largest go first so that both
workers stay busy while the single presets fill in.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from tests.e2e.harness import Row, row_family_key, run_rows, run_steady_rows, steady_family_key
from tests.support import require_tool

WORKERS = 2  # CI's machine has two cores
# A safety net against a hung row, not a budget: one row takes 10–40 s on an idle 2-core machine
# and several times that on a loaded one. The fixture's wait grows with the rows it computes.
ROW_SAFETY_NET_S = 300.0


def _families(pool: ProcessPoolExecutor, key: Callable[[str], Hashable], names: Sequence[str]) -> list[list[str]]:
    """``names`` grouped by ``key`` (computed in the pool), largest group first; a preset whose
    key cannot be computed is a family of its own (its run then says what is wrong)."""
    futures = {n: pool.submit(key, n) for n in names}
    groups: dict[Hashable, list[str]] = {}
    for n, f in futures.items():
        try:
            k = f.result()
        except Exception:
            k = ("alone", n)
        groups.setdefault(k, []).append(n)
    return sorted(groups.values(), key=len, reverse=True)


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
        families = _families(pool, row_family_key, names)
        futures = {tuple(fam): pool.submit(run_rows, fam, {n: dirs[n] for n in fam}) for fam in families}
        for fam, f in futures.items():
            try:
                rows.update(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as exc:  # one broken family fails its own tests, not the matrix
                rows.update(dict.fromkeys(fam, exc))
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
        futures = {tuple(fam): pool.submit(run_steady_rows, fam) for fam in _families(pool, steady_family_key, names)}
        rows: dict[str, dict | BaseException] = {}
        for fam, f in futures.items():
            try:
                rows.update(f.result())
            except Exception as exc:  # one broken family fails its own tests, not the matrix
                rows.update(dict.fromkeys(fam, exc))
    return rows
