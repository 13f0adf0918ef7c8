"""asyncio front end: the same engine, awaited instead of blocked on.

The engine's threads deliver each request's events through a sink; here the
sink hands them to the event loop with `call_soon_threadsafe`, so nothing in
the loop ever blocks on the engine. Cancelling the awaiting task (or leaving an
`async for` early) cancels the request, and its blocks come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import Engine, Result, UnknownRequestError


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def from_config(cls, config, **kwargs) -> AsyncEngine:
        """Builds (and warms up) synchronously: call it before the event loop is busy,
        or through `await asyncio.to_thread(AsyncEngine.from_config, ...)`."""
        return cls(Engine.from_config(config, **kwargs))

    async def _events(self, prompt, params, kwargs) -> AsyncIterator[tuple]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        rid = self.engine.submit(
            prompt, params, **kwargs,
            _sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        done = False
        try:
            while True:
                event = await events.get()
                done = event[0] == "done"
                yield event
                if done:
                    return
        finally:
            if not done:
                try:
                    self.engine.cancel(rid)
                except UnknownRequestError:
                    pass  # it finished meanwhile

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     **kwargs) -> AsyncIterator[tuple[int, str]]:
        """Yields (token id, text delta) as tokens are produced, and a last (None, text)
        for text held back (a possible stop string or an incomplete character)."""
        async for event in self._events(prompt, params, kwargs):
            if event[0] != "done":
                yield event[1], event[2]

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs) -> Result:
        async for event in self._events(prompt, params, kwargs):
            if event[0] == "done":
                return event[1]
        raise RuntimeError("the request ended without a result")

    async def generate_many(self, prompts, params: SamplingParams | None = None
                            ) -> list[Result]:
        return list(await asyncio.gather(*(self.generate(p, params) for p in prompts)))

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def metrics(self) -> dict:
        return self.engine.metrics()

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
