"""Routes whose every error, their dependencies' (the API key) included, is answered in one API's
own shape (Anthropic's, Ollama's) rather than the app's OpenAI one."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from axon.server.generation import ClientDisconnected


def error_shaped_route(error_response: Callable[[Exception], Response]) -> type[APIRoute]:
    """An APIRoute class that answers any exception of its handler with `error_response(exc)`;
    a client that went away is left to the app's handler, which closes quietly."""

    class ErrorShapedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def handle(request: Request):
                try:
                    return await handler(request)
                except ClientDisconnected:
                    raise  # nobody reads the answer
                except Exception as exc:  # noqa: BLE001 - every error is answered in this shape
                    return error_response(exc)

            return handle

    return ErrorShapedRoute
