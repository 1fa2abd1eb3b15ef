"""Request-sized work off the event loop: chat-template rendering, tokenization, building a
large response. It runs on its own small thread pool, not asyncio's default one, so a burst of
long prompts cannot starve the threads that `/health`, the model registry and the engine
clients rely on."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="axon-prompt")


async def off_loop(function, /, *args, **kwargs):
    """`function(*args, **kwargs)` on the request pool; its exception is raised here."""
    call = functools.partial(contextvars.copy_context().run, function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)
