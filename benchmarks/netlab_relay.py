"""The network lab's latency: a TCP relay that delays every chunk by the two links' one-way delays.

This kernel has no `netem`, so benchmarks/netlab.py adds delay above TCP. The relay runs on an asyncio
loop in a thread of the lab's process, listens on the lab bridge's address (one port per exposed
host:port) and forwards each connection to the host. A chunk read from either side is written to the
other `delay_ms[dialler] + delay_ms[dialled]` after it arrived (the dialler is known by its source
address; this namespace's own address has no delay). Chunks queue, so the delay does not cap the
throughput (the links' `tbf` does); a full queue (MAX_QUEUED_CHUNKS) stops reading, so TCP's flow
control holds a fast sender back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
MAX_QUEUED_CHUNKS = 256  # 16 MiB per direction: above a bandwidth-delay product of 100 Mbit/s x 1 s
START_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0


class DelayRelay:
    def __init__(self, listen_address: str, delay_ms: dict[str, float]):
        self.listen_address = listen_address
        self.delay_ms = dict(delay_ms)  # host address -> its link's one-way delay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        ready = threading.Event()

        def main():
            self._loop = asyncio.new_event_loop()
            self._loop.call_soon(ready.set)
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=main, name="netlab-relay", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the lab's relay loop did not start in {START_TIMEOUT_S:.0f} s")

    def forward(self, address: str, port: int, listen_port: int = 0) -> int:
        """Relay listen_address:listen_port (0: any free port) to address:port; the port it listens on."""
        future = asyncio.run_coroutine_threadsafe(self._serve(address, port, listen_port), self._loop)
        return future.result(START_TIMEOUT_S)

    async def _serve(self, address: str, port: int, listen_port: int) -> int:
        async def handle(reader, writer):
            task = asyncio.current_task()
            self._tasks.add(task)
            try:
                await self._relay(reader, writer, address, port)
            finally:
                self._tasks.discard(task)

        server = await asyncio.start_server(handle, self.listen_address, listen_port)
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def _relay(self, client_r, client_w, address: str, port: int) -> None:
        source = client_w.get_extra_info("peername")[0]
        delay_s = (self.delay_ms.get(source, 0.0) + self.delay_ms.get(address, 0.0)) / 1000.0
        try:
            server_r, server_w = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.info("relay to %s:%d failed: %s", address, port, exc)
            client_w.close()
            return
        try:
            await asyncio.gather(_pump(client_r, server_w, delay_s), _pump(server_r, client_w, delay_s))
        finally:
            for writer in (client_w, server_w):
                writer.close()

    def stop(self) -> None:
        """Idempotent: close the listeners and every relayed connection, end the loop's thread."""
        if self._loop is None or self._loop.is_closed():
            return

        async def shutdown():
            for server in self._servers:
                server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(START_TIMEOUT_S)
        except Exception as exc:  # the loop is gone or stuck: the daemon thread dies with the process
            logger.warning("the lab's relay did not stop cleanly: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader to writer, each chunk delay_s after it was read; EOF travels with the same delay."""
    queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_CHUNKS)

    async def read():
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                await queue.put((time.monotonic() + delay_s, chunk))
        except OSError as exc:  # the peer reset: end this direction like an EOF
            logger.debug("a relayed connection ended: %s", exc)
        await queue.put((time.monotonic() + delay_s, b""))

    reading = asyncio.ensure_future(read())
    try:
        while True:
            due_s, chunk = await queue.get()
            wait_s = due_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
    except OSError:
        return
    finally:
        reading.cancel()
