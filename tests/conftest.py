"""Test setup: 8 host devices (must precede any jax import) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    from jaxdisagg.model import Llama, get_preset

    return Llama(get_preset("tiny"), seed=0)
