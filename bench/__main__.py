"""Run every benchmark module in ``bench/`` and print one table; exit 1 if a target is missed."""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from exporter import allocator

COLUMNS = ("name", "value", "baseline", "ratio", "target", "ok")
# Modules with a command line of their own, not a ``run()`` of in-process rows (``make bench-cluster``,
# and the KV subscriber alone against the same busy fleet).
STANDALONE = frozenset({"cluster", "cluster_subscriber"})


def discover() -> list[str]:
    """Benchmark modules: every ``bench/<name>.py`` except the package's own files and the standalone ones."""
    here = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if not m.name.startswith("_") and m.name not in STANDALONE)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table (also valid Markdown, so it can be pasted into the README)."""
    cells = [list(COLUMNS)] + [[_cell(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def run_modules(names: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for name in names:
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}")
            produced = list(module.run())
        except Exception:  # one broken benchmark must not hide the others' results
            failures.append(f"bench.{name} failed:\n{traceback.format_exc()}")
            rows.append({"name": f"{name} (failed)", "ok": False})
            continue
        rows.extend(produced)
        print(f"bench.{name}: {len(produced)} row(s) in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("modules", nargs="*", help="benchmark modules to run (default: all)")
    args = parser.parse_args(argv)
    available = discover()
    unknown = sorted(set(args.modules) - set(available))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)} (available: {', '.join(available)})")
    # glibc's allocator as the exporter's process sets it (exporter.main), for every module alike:
    # set by one module, it would hold for the modules after it and not before
    allocator.limit_arenas()
    allocator.heap_large_blocks()
    rows, failures = run_modules(args.modules or available)
    print(format_table(rows))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
