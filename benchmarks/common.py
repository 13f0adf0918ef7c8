"""What every benchmark script shares: timing and writing the JSON result."""

import json
from pathlib import Path

from jaxdisagg.roofline import median_seconds  # noqa: F401 - the scripts import it from here


def write_result(path: str, result: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
