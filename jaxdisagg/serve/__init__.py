"""Serving: block accounting and prefix cache, prefill and decode schedulers, pool
workers, the engines and their Python/asyncio API, the gRPC server, router and
cross-process pools, Prometheus metrics, and `jaxdisagg demo`."""
