"""``make fuzz`` in small: every intake's target runs (a few hundred inputs each) and none crashes.

The full run (``python -m fuzz.run``, a million inputs per target) is too long for the suite; this
keeps the targets themselves working — the OTLP protobuf and JSON intake and the record parser
beside the KV decoder and the text parser.
"""

from __future__ import annotations

import pytest

from fuzz import run


def test_every_intake_is_a_fuzz_target_and_a_short_run_finds_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--inputs", "300", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    for target in ("kv-decoder", "text-parser", "otlp-protobuf", "otlp-json", "records"):
        assert f"{target}: 300 inputs, 0 crashes" in out
