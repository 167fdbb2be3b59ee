"""``python -m bench`` runs every in-process benchmark module by calling its ``run()`` with no
arguments; a module with a command line of its own must be listed as standalone, or the whole
run reports it as failed."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

from bench.__main__ import STANDALONE, discover


def test_every_discovered_module_has_a_run_that_takes_no_arguments() -> None:
    for name in discover():
        run = importlib.import_module(f"bench.{name}").run
        required = [p for p in inspect.signature(run).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert not required, f"bench.{name}.run needs {[p.name for p in required]}: list it in STANDALONE"


def test_standalone_modules_exist() -> None:
    for name in STANDALONE:
        assert importlib.util.find_spec(f"bench.{name}") is not None
