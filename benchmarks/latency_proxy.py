"""A TCP proxy on 127.0.0.1 that adds a fixed delay to every request, for benchmarks.

    python benchmarks/latency_proxy.py TARGET_PORT DELAY_MS    # prints its own port

Forwards each connection to ``127.0.0.1:TARGET_PORT``. Whenever the client sends after the
server has answered (a new HTTP request on a kept-alive connection, or the body after a
``100 Continue``), the proxy waits ``DELAY_MS`` before forwarding it: one round trip of
latency per exchange, as a distant object store has, in front of a local server (moto,
which answers in about a millisecond and so hides what latency costs). Bytes are not
delayed otherwise, so bandwidth is the loopback's.
"""

from __future__ import annotations

import asyncio
import sys


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    state: dict[str, bool],
    delay: float,
    client_side: bool,
) -> None:
    try:
        while data := await reader.read(1 << 16):
            if client_side and state["answered"]:
                state["answered"] = False
                await asyncio.sleep(delay)
            elif not client_side:
                state["answered"] = True
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _serve(target_port: int, delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        state = {"answered": True}  # the first bytes a client sends start a request
        await asyncio.gather(
            _pump(client_r, server_w, state, delay, client_side=True),
            _pump(server_r, client_w, state, delay, client_side=False),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), float(sys.argv[2]) / 1000))
