"""Serving: KV block accounting and prefix cache (engines, schedulers and API to come)."""
