"""Stage calls over one long-lived stream per peer: hivemind's per-call cost paid once per session (issue 29).

Every hivemind call of ours paid a fixed cost, whatever it carried: a unary call goes through p2pd's control
connection and a libp2p stream of its own, a streamed call opens a new unix connection and a new libp2p stream
(protocol negotiation included). Measured on loopback, a 1 KiB round trip with both processes' and both daemons'
CPU: unary 2.1 ms of CPU (1.1 ms wall), a stream per call 2.2 ms, **one message each way on a stream that is
already open 0.48 ms** (0.36 ms wall); 64 KiB: 4.2 / 3.2 / 1.2 ms; 512 KiB: - / 8.0 / 5.0 ms. A digits micro-batch
crosses five such hops.

So a caller keeps one ``rpc_session`` stream per (peer, namespace) and sends every call that fits
``SESSION_LIMIT_BYTES`` on it; each request carries a call id (``ExpertRequest.uid``), the server answers each as
soon as it is done, in any order, with the id in the reply's metadata (``"cid"``), and the caller hands the reply
to the call that waits for it. What a call means, how it is checked and signed, and who is blamed for what it
carries do not change: the server runs the same ``StageServicer._handle`` as for a unary call, with the same
``P2PContext`` (the stream's authenticated remote peer). Payloads over the limit keep their own stream (a large
message would hold every small one behind it).

Failures stay per call: a call that times out is dropped from the session (a late reply is discarded); a stream
that breaks fails every call waiting on it with ``SessionBroken`` (a ``ConnectionError``: the hop is retried at
another peer, as for a cut unary call) and the next call opens a new session. A session that answers nothing
while its calls time out takes no new calls and closes once those still waiting are done (``STUCK_TIMEOUTS``), and one idle for ``IDLE_S`` is closed by the next call
that opens another. A peer without the handler (an older version) gets unary calls for ``NO_SESSION_S``; a peer
that cannot be reached fails the call at once (a unary call would only dial it again).

On the server (session_server.py), one session runs at most ``MAX_RUNNING`` calls at once; more are answered ``busy``
unread (the stage's fair queue and gate still decide everything else, per requester, as for unary calls). Both sides
write each message in one piece and read with a bound (frames.py); the bytes are hivemind's framing, so a caller or
server of an earlier version still talks to this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections import OrderedDict
from typing import Any

from hivemind.proto import runtime_pb2

from swarm.pipeline.transport.frames import Ended, read_message, write_end, write_message
from swarm.pipeline.transport.wire import WireError, unpack_metadata

logger = logging.getLogger(__name__)

# a call whose request or reply may be larger keeps its own stream: a 512 KiB round trip costs 5.0 ms of CPU on a
# session against 8.0 as a stream per call, 2 MiB 24.6 against 26.1 (and a large message holds the small ones behind it)
SESSION_LIMIT_BYTES = 2 * 2**20
IDLE_S = 60.0  # a session unused this long is closed (by the next session opened)
NO_SESSION_S = 60.0  # a peer whose session could not be opened gets unary calls this long
STUCK_TIMEOUTS = 2  # timeouts in a row with no reply in between: the session retires, the next call opens another
MAX_RUNNING = 32  # calls one session runs at once on a server (at least; a stage allows twice its per-driver cap)
MAX_CALL_ID_CHARS = 20
MAX_UNMATCHED = 16  # replies to calls nobody made (beyond the late ones) before a session is closed as hostile
NO_HANDLER = "protocols not supported"  # what p2pd says when the peer has no such handler (measured, 1.1.12)
# benchmarks switch sessions off to measure the same code without them: VOLUNTEER_STAGE_SESSIONS=0 in a process's
# environment (read at each call, not at import: a process forked from one that imported this has its own), or
# ENABLED set in-process (None: the environment decides)
ENABLED: bool | None = None


def enabled() -> bool:
    return ENABLED if ENABLED is not None else os.environ.get("VOLUNTEER_STAGE_SESSIONS", "1") != "0"


class SessionBroken(ConnectionError):
    """The session's stream ended or failed: the calls waiting on it were not answered."""


class SessionUnopened(SessionBroken):
    """No session could be had, so the call was never sent (a push falls back to the relay at once: push.py)."""


# ----- client


class ClientSession:
    """One open ``rpc_session`` stream to a peer, and the calls waiting for their replies on it.

    It reads and writes hivemind's framing on the raw stream itself (frames.py: each message in one write, each
    reply read with a bound): hivemind's own stream caller waits for its writer to finish after the peer's side
    ends, and a session's writer is never finished, so a session the peer closed would never say so.
    """

    def __init__(self, p2p: Any, key: tuple[str, str]):
        self.p2p_ref = weakref.ref(p2p)
        self.key = key  # (peer id, namespace)
        self.loop = asyncio.get_running_loop()
        self.waiting: dict[str, asyncio.Future] = {}
        self.next_id = 0
        self.opened: asyncio.Future = self.loop.create_future()
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.Task | None = None
        self.closed = False
        self.retired = False  # no new calls: closed once those waiting are done (retire)
        self.last_used = time.monotonic()
        self.last_reply = time.monotonic()
        self.timeouts_in_a_row = 0
        self.unmatched = 0  # replies to no call waiting: late ones (after a timeout or a lost hedge), or a flood
        self.given_up = 0  # calls that stopped waiting before their reply: the late replies they may still get

    async def open(self, p2p: Any, handle_name: str) -> None:
        from hivemind.p2p import PeerID

        try:
            _, reader, self.writer = await p2p.call_binary_stream_handler(PeerID.from_base58(self.key[0]),
                                                                          handle_name)
        except BaseException as exc:
            self.close(exc)
            raise
        if self.closed:  # closed while opening
            self.writer.close()
            raise SessionUnopened("the session was closed while it opened")
        self.reader = asyncio.create_task(self._read(reader), name=f"stage-session-{self.key[0][-8:]}")
        self.opened.set_result(True)
        served = _SERVED.setdefault(p2p, OrderedDict())
        served[self.key] = None
        served.move_to_end(self.key)
        while len(served) > SERVED_KEEP:
            served.popitem(last=False)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = SessionBroken("the peer closed the session")
        try:
            while True:
                self._deliver(await read_message(reader, runtime_pb2.ExpertResponse))
        except Ended as exc:
            error = SessionBroken(f"the peer's session failed: {exc.message}" if exc.message else
                                  "the peer ended the session")
        except asyncio.IncompleteReadError:  # the stream ended
            pass
        except asyncio.CancelledError:
            error = SessionBroken("the session was closed")
            raise
        except Exception as exc:  # a broken stream, a frame over the limit, garbage
            error = SessionBroken(f"the session broke: {exc.__class__.__name__}: {str(exc)[:200]}")
        finally:
            self.close(error)

    def _deliver(self, reply: runtime_pb2.ExpertResponse) -> None:
        try:
            meta = unpack_metadata(reply.metadata)
        except WireError as exc:
            logger.info("a session reply from %s without readable metadata was dropped: %s", self.key[0][-8:], exc)
            meta = {}
        cid = meta.pop("cid", None)
        future = self.waiting.pop(cid, None) if isinstance(cid, str) else None
        if future is None or future.done():
            self.unmatched += 1
            if self.unmatched > self.given_up + MAX_UNMATCHED:  # more than it was ever asked: not a slow peer
                self.close(SessionBroken(f"the peer sent {self.unmatched} replies to calls nobody made"))
            return
        self.last_reply = time.monotonic()
        self.timeouts_in_a_row = 0
        future.set_result((list(reply.tensors), meta))

    async def call(self, tensors: list[Any], metadata: bytes, timeout_s: float) -> tuple[list[Any], dict]:
        """Send one request on the session and wait for its reply: (serialized tensors, reply metadata)."""
        if self.closed:
            raise SessionUnopened("the session is closed")
        self.next_id += 1
        cid = str(self.next_id)
        future = self.loop.create_future()
        self.waiting[cid] = future
        self.last_used = started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):  # one deadline for both, and no task per call
                # one request's bytes go out whole, in one write, before the only await (drain)
                write_message(self.writer, runtime_pb2.ExpertRequest(uid=cid, tensors=tensors, metadata=metadata))
                await self.writer.drain()
                return await future
        except TimeoutError:
            self.timeouts_in_a_row += 1
            if self.timeouts_in_a_row >= STUCK_TIMEOUTS and self.last_reply < started:
                self.retire()
            raise
        except (ConnectionError, OSError) as exc:
            self.close(exc)
            raise SessionBroken(f"the session broke while sending: {exc}") from None
        finally:
            if future.done() and not future.cancelled():
                future.exception()  # the stream broke as this call was cancelled: its error is seen, not logged
            if self.waiting.pop(cid, None) is not None:  # a timeout, a cancelled hedge: its reply may still come
                self.given_up += 1
            if self.retired and not self.waiting:
                self.close(SessionBroken("the session answered nothing while its calls timed out"))

    def retire(self) -> None:
        """New calls open a new session; this one closes when the calls still waiting on it are done. A busy peer's
        slow answers are not a broken stream: its other calls keep waiting for their own replies and deadlines."""
        self.retired = True
        self._unregister()
        if not self.waiting:
            self.close(SessionBroken("the session answered nothing while its calls timed out"))

    def _unregister(self) -> None:
        p2p = self.p2p_ref()
        sessions = _SESSIONS.get(p2p) if p2p is not None else None
        if sessions is not None and sessions.get(self.key) is self:
            del sessions[self.key]

    def close(self, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._unregister()
        if self.writer is not None:  # the server answers what it was asked, then ends its side
            with contextlib.suppress(Exception):
                write_end(self.writer)
                self.writer.close()
        if not isinstance(error, SessionBroken):
            error = SessionBroken(f"the session was closed ({error.__class__.__name__ if error else 'by this node'})")
        if not self.opened.done():
            self.opened.set_exception(error)
            self.opened.exception()  # retrieved: nobody else may wait for it
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error)
        self.waiting.clear()
        if self.reader is not None and self.reader is not _current_task():
            self.reader.cancel()


def _current_task() -> asyncio.Task | None:
    """The running task; None where no loop runs (a session's reader closed by the garbage collector after its loop
    stopped: it must end quietly, not raise from its finalizer)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


# per P2P instance (a node's, a test's): its sessions die with it
_SESSIONS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], ClientSession]] = weakref.WeakKeyDictionary()
_NO_SESSION_UNTIL: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], float]] = weakref.WeakKeyDictionary()
# (peer, namespace) that have served this node a session: such a peer without the handler is leaving, not older
_SERVED: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], None]] = weakref.WeakKeyDictionary()
SERVED_KEEP = 4096


def _usable(session: ClientSession | None) -> bool:
    return session is not None and not session.closed and session.loop is asyncio.get_running_loop()


def open_session(p2p: Any, peer_id: str, namespace: str) -> ClientSession | None:
    """The session already open to ``peer_id``, if any (the common case: no task, no wait)."""
    session = _SESSIONS.get(p2p, {}).get((peer_id, namespace))
    return session if _usable(session) and session.opened.done() else None


async def session_for(p2p: Any, peer_id: str, namespace: str, handle_name: str) -> ClientSession | None:
    """The open session to ``peer_id`` (opened now if there is none), or None where calls go unary."""
    if not enabled():
        return None
    key = (peer_id, namespace)
    now = time.monotonic()
    unary_until = _NO_SESSION_UNTIL.setdefault(p2p, {})
    if unary_until.get(key, 0.0) > now:
        return None
    sessions = _SESSIONS.setdefault(p2p, {})
    session = sessions.get(key)
    if not _usable(session):
        _close_idle(sessions, unary_until, now)
        session = sessions[key] = ClientSession(p2p, key)
        try:
            await session.open(p2p, handle_name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if NO_HANDLER not in str(exc):  # the peer cannot be reached: a unary call would dial it again in vain
                raise SessionUnopened(f"could not open a session: {exc.__class__.__name__}: {str(exc)[:200]}") from None
            if key in _SERVED.get(p2p, ()):  # it served us sessions: it is leaving this stage, not an older version
                raise SessionUnopened(f"{peer_id[-8:]} no longer serves {namespace} (leaving)") from None
            unary_until[key] = now + NO_SESSION_S
            logger.info("%s serves no sessions (an older version): unary calls for %.0f s", peer_id[-8:],
                        NO_SESSION_S)
            return None
    else:
        try:
            await asyncio.shield(session.opened)
        except SessionBroken:  # another call's opening failed: this one goes unary
            return None
    return session


def _close_idle(sessions: dict[tuple[str, str], ClientSession], unary_until: dict[tuple[str, str], float],
                now: float) -> None:
    for session in [s for s in sessions.values() if now - s.last_used > IDLE_S and not s.waiting]:
        session.close(SessionBroken("idle"))
    for key in [k for k, until in unary_until.items() if until <= now]:
        del unary_until[key]


def close_sessions(p2p: Any) -> list[asyncio.Task]:
    """Close every session of one P2P instance (a node that leaves; tests): each server is told the calls ended and
    answers what it was asked before it ends its side. Returns the sessions' reading tasks (cancelled) to await."""
    readers = []
    for session in list(_SESSIONS.get(p2p, {}).values()):
        session.close(SessionBroken("closed by this node"))
        if session.reader is not None:
            readers.append(session.reader)
    return readers
