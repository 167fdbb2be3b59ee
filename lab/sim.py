"""``prefixscope sim``: the simulated fleet (``fleet.cli``), composed with the threshold file.

The fleet never reads the threshold file: this composition root reads it once and hands the
fleet what it needs (the cold share, so the reference router and the exporter call the same
requests cold) and, for an accelerated run, the table of each check's recounted value before and
after the fault (``lab.recount``).
"""

from __future__ import annotations

import sys
from functools import partial

from fleet import cli as fleet_cli
from lab.recount import signal_table
from prefixscope.thresholds import ConfigError, load_thresholds


def main(argv: list[str] | None = None) -> int:
    try:
        th = load_thresholds()
    except ConfigError as exc:
        print(f"prefixscope sim: {exc}", file=sys.stderr)
        return 2
    return fleet_cli.main(argv, cold_share=th.cold_reuse_share, report=partial(signal_table, thresholds=th))


if __name__ == "__main__":
    sys.exit(main())
