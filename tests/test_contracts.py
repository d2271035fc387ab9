"""Contract tests for every library internal read in proxy/contracts.py: each fails with a clear
message when aiohttp or websockets changes what the accessor relies on."""

from __future__ import annotations

import proxy.contracts

# --- aiohttp -------------------------------------------------------------------------------


async def test_abstract_unix_connector_overrides_what_aiohttp_calls() -> None:
    import inspect

    import aiohttp

    base = aiohttp.UnixConnector
    assert "_create_connection" in vars(base), "aiohttp.UnixConnector no longer has _create_connection"
    params = list(inspect.signature(base._create_connection).parameters)
    assert params == ["self", "req", "traces", "timeout"], params
    connector = proxy.contracts.AbstractUnixConnector(path="\0x")
    assert callable(connector._factory) and connector._loop is not None  # noqa: SLF001
    await connector.close()


def test_abstract_unix_connector_reaches_an_abstract_socket_on_uvloop() -> None:
    # uvloop's create_unix_connection(path=...) refuses abstract names: the reason it exists.
    import aiohttp
    import pytest
    from aiohttp import web

    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        name = "\0upshift-contract-" + str(id(app))
        await web.UnixSite(runner, name).start()
        try:
            async with aiohttp.ClientSession(connector=proxy.contracts.AbstractUnixConnector(path=name)) as session:
                async with session.get("http://localhost/") as resp:
                    assert resp.status == 200 and await resp.text() == "hello"
        finally:
            await runner.cleanup()

    uvloop.run(main())


# --- websockets ----------------------------------------------------------------------------


def test_module_imports() -> None:
    assert proxy.contracts.__doc__
