"""``make fuzz`` in small: every intake's target runs (a few hundred inputs each) and none crashes.

The full run (``python -m fuzz.run``, a million inputs per target) is too long for the suite; this
keeps the targets themselves working — every intake: the KV decoder, the text parser, the OTLP
protobuf and JSON intake (in process and, a share of it, through a running exporter's
``POST /v1/traces`` and gRPC ``Export``), request records, router pages and NATS messages.
"""

from __future__ import annotations

import re

import pytest

from fuzz import run


def test_every_intake_is_a_fuzz_target_and_a_short_run_finds_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--inputs", "300", "--seed", "7", "--server-every", "10"]) == 0
    out = capsys.readouterr().out
    for target in ("kv-decoder", "text-parser", "otlp-protobuf", "otlp-json", "records", "router-pages",
                   "nats-messages"):
        assert f"{target}: 300 inputs, 0 crashes" in out
    assert "failures: 0 HTTP, 0 gRPC, 0 scrapes" in out
    sent = re.search(r"(\d+) POST /v1/traces, (\d+) gRPC Export, (\d+) scrapes", out)
    assert sent is not None and int(sent[1]) > 0 and int(sent[2]) > 0 and int(sent[3]) > 0, out
