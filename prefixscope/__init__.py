"""prefixscope's contract: the catalogue, thresholds, durations, topology format, the diagnosis
rule, units and schemas. Every other package reads this one; it imports none of them."""

__version__ = "0.1.0"

from pathlib import Path

SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
REQUEST_SCHEMA_PATH = SCHEMAS_DIR / "request.v1.json"
