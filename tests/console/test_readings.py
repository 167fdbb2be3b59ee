"""Not instrumented (a signal has no source) is told apart from no data in the window."""

from __future__ import annotations

from console.chain import NO_DATA, CheckState, StepState
from console.readings import check_line, check_shown, step_shown
from prefixscope.catalog import CHECKS_BY_KEY, SIGNAL_ENABLE

EMPTY = CheckState(CHECKS_BY_KEY["async_prefill_wait_time_p99"], None, 5.0, "not_instrumented", (NO_DATA,))
UNWIRED = CheckState(CHECKS_BY_KEY["cold_prefill_time_p99"], None, 3.0, "not_instrumented", ("prefill_timing",))


def test_a_check_with_sources_but_no_data_is_not_called_uninstrumented() -> None:
    assert (check_shown(EMPTY), check_shown(UNWIRED)) == ("no_data", "not_instrumented")
    assert "no data in the window" in check_line(EMPTY) and "missing signal" not in check_line(EMPTY)
    assert "not instrumented] · missing signal: prefill_timing · to enable prefill_timing: " in check_line(UNWIRED)
    assert check_line(UNWIRED).endswith(SIGNAL_ENABLE["prefill_timing"])


def test_a_step_is_uninstrumented_only_when_none_of_its_causes_has_a_source() -> None:
    assert step_shown(StepState(3, "Cold-miss cost", "?", "not_instrumented", (EMPTY, UNWIRED))) == "no_data"
    assert step_shown(StepState(3, "Cold-miss cost", "?", "not_instrumented", (UNWIRED,))) == "not_instrumented"
    assert step_shown(StepState(3, "Cold-miss cost", "?", "ok", (UNWIRED,))) == "ok"
