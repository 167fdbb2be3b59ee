"""prefixscope benchmarks: ``python -m bench`` runs every module here and prints one table.

Each benchmark module exposes ``run() -> list[dict]`` with rows
``{name, value, baseline, ratio, target, ok}``: ``value`` and ``baseline`` are measured in the
same run on the same machine, so the ``ratio`` is meaningful where absolute timings are not.
"""
