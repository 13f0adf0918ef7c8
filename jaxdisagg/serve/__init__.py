"""Serving: block accounting and prefix cache, prefill and decode schedulers, the
disaggregated core loop, and the `Engine` Python API."""
