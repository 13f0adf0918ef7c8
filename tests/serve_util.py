"""Helpers the stepped-engine tests share."""

import numpy as np

from jaxdisagg.mesh.config import RouterConfig
from jaxdisagg.serve.engine import ColocatedEngine, DisaggregatedEngine


def prompts(seed, lens):
    """Random token-id prompts of the given lengths (ids below 256: bytes of `tiny`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


def engine_for(dep, **router):
    """The deployment's engine, stepped by the test (start=False)."""
    cls = ColocatedEngine if dep.config.mode == "colocated" else DisaggregatedEngine
    return cls(dep, start=False, router=RouterConfig(**router) if router else None)


def assert_all_back(engine):
    """Every block of every pool free again, and no request left anywhere."""
    for name, mgr in engine.block_managers().items():
        mgr.check()
        assert mgr.num_available == mgr.num_blocks, f"{name}: blocks leaked"
    for w in engine.decoders:
        assert not w.decode.active and not w.ready and w.handoffs.empty()
    for w in engine.prefillers:
        assert not w.scheduler.queue
