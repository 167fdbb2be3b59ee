"""``prefixscope catalog``: print the metric catalogue."""

from __future__ import annotations

import argparse

from prefixscope import catalog


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefixscope catalog", description=__doc__)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    print(catalog.to_json() if args.format == "json" else catalog.to_table())
    return 0
