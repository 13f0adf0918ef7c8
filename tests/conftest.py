"""Test setup: 8 host devices (must precede any jax import) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The deployment secret of the internal channels: every process the tests start
# inherits it (tests/test_security.py starts processes without it on purpose).
os.environ.setdefault("JAXDISAGG_SECRET", "test-" + os.urandom(16).hex())
# One persistent compilation cache for this session and every process it starts:
# the servers, launches and docs blocks the tests run compile the same programs,
# and a hit loads them instead of compiling again. A fresh directory per session,
# so nothing outlives the run (test_transfer's no-compilation check counts lowering,
# which a cache hit still does).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdisagg-jit-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    from jaxdisagg.model import Llama, get_preset

    return Llama(get_preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def deployments():
    """deployments(name) -> the configs/<name> Deployment, built and warmed up once.

    Tests share the pools: each test keeps its own block accounting, and pages are
    always written before they are read, so what an earlier test left is never seen.
    """
    from pathlib import Path

    from jaxdisagg.mesh import Deployment

    configs = Path(__file__).resolve().parents[1] / "configs"
    built = {}

    def get(name):
        if name not in built:
            built[name] = Deployment.build(str(configs / name))
        return built[name]

    return get
