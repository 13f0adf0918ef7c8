"""The CPU kernels' other code path. They size their register blocks by the target's
vector width (`cpu_common.h`: 16 lanes with AVX-512, 8 with AVX2), so a host runs one of
two builds. On an AVX-512 host this builds the AVX2 one (`JAXDISAGG_CPU_MARCH`, into a
fresh cache) and runs the kernels' comparisons against their references with it, in a
subprocess: random ragged inputs, real head layouts, whole decode steps."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_cpu_kernel.py", "tests/test_cpu_product.py", "tests/test_cpu_sample.py"]


def has_avx512() -> bool:
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} "
    except OSError:
        return False


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 build is x86's")
@pytest.mark.skipif(not has_avx512(), reason="this host's own build is the AVX2 one, "
                    "which test_cpu_kernel, test_cpu_product and test_cpu_sample ran")
def test_the_avx2_build_matches_the_references(tmp_path):
    env = dict(os.environ, JAXDISAGG_CPU_MARCH="x86-64-v3", JAXDISAGG_CACHE=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES,
         "-k", "not builds_once and not without_a_compiler"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert list(tmp_path.glob("cpu_decode-*.so")), "the AVX2 build was not the one tested"
