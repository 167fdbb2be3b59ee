"""The scenario matrix's rows, computed once per session on both cores."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.e2e.harness import PROMTOOL, Row, run_row, run_steady_row

WORKERS = 2  # CI's machine has two cores


@pytest.fixture(scope="session")
def matrix_rows(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row | BaseException]:
    """Every scenario the selected tests ask for, replayed and evaluated in worker processes."""
    if PROMTOOL is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    names = sorted({item.callspec.params["scenario"] for item in request.session.items
                    if "matrix_rows" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})
    dirs = {n: tmp_path_factory.mktemp(n) for n in names}
    # fork would copy the test runner's threads' locks; spawn starts clean interpreters
    with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {n: pool.submit(run_row, n, dirs[n]) for n in names}
        rows: dict[str, Row | BaseException] = {}
        for n, f in futures.items():
            try:
                rows[n] = f.result()
            except Exception as exc:  # one broken scenario fails its own tests, not the matrix
                rows[n] = exc
    return rows


@pytest.fixture(scope="session")
def steady_rows(request: pytest.FixtureRequest) -> dict[str, dict | BaseException]:
    """Every scenario the selected steady-state tests ask for, after the warm-up, in worker processes."""
    names = sorted({item.callspec.params["scenario"] for item in request.session.items
                    if "steady_rows" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})
    with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {n: pool.submit(run_steady_row, n) for n in names}
        rows: dict[str, dict | BaseException] = {}
        for n, f in futures.items():
            try:
                rows[n] = f.result()
            except Exception as exc:  # one broken scenario fails its own test, not the matrix
                rows[n] = exc
    return rows
