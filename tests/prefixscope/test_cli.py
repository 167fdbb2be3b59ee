"""The ``prefixscope`` command: dispatch, and a reader that closes the pipe early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefixscope import catalog
from prefixscope.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_table_is_printed(capsys) -> None:
    assert main(["catalog"]) == 0
    assert capsys.readouterr().out == catalog.to_table() + "\n"


def test_unknown_command_exits_2(capsys) -> None:
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """``prefixscope catalog | head`` must not end in a BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The reader is gone before the command writes anything: every write meets a closed pipe,
    # whatever the size of the output and however fast the machine is.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "catalog", "--format", "json"],
                                stdout=write_end, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    finally:
        os.close(write_end)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err
