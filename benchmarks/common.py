"""What every benchmark script shares: timing and writing the JSON result."""

import json
import statistics
import time
from pathlib import Path


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call.

    fn must block until its work is done (block_until_ready on what it returns).
    """
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_result(path: str, result: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
