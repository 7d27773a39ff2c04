"""A DHT reader for one-shot commands (`volunteer status`) that never imports torch.

Why: ``import hivemind`` imports torch and scipy (hivemind's averaging, MoE and optimizer packages, and
``MPFuture``, which the ``DHT`` process class needs), 1.1 s of a 2 s `volunteer status` on a quiet
machine and 5-7 s of it on a loaded one. Reading records needs none of that: ``DHTNode`` (asyncio),
``P2P`` (the daemon's client) and the record validators import no torch themselves.

How: ``light_hivemind()`` registers the packages ``hivemind``, ``hivemind.utils`` and ``hivemind.dht``
as lazy stand-ins before anything imports them: a submodule loads from the real package directory as
usual, and a name the real ``__init__`` re-exports (``from hivemind.utils import get_logger``) is
imported from the submodule that defines it, read off the real ``__init__.py`` with ``ast``, on first
use. Only the submodules a reader touches are loaded. Call it only in a process that does not need
the rest of hivemind (it refuses if hivemind is already imported, and then the full import is used).

``LightDHT`` runs a ``DHTNode`` on an event loop thread of this process (no DHT child process, no
bootstrap of our own node id: a reader only gets) and offers the part of ``hivemind.DHT`` that
``swarm.dht.membership.Membership`` reads with: ``get(key, latest=True, return_future=True)`` returning a
future with ``result(timeout)`` and ``cancel()``, and ``shutdown()``. p2pd joins the caller's watchdog
process group, as the DHT process's does, so it is reaped if we are killed.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import logging
import os
import sys
import threading
import types
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LAZY_PACKAGES = ("hivemind", "hivemind.utils", "hivemind.dht")
READER_BOOTSTRAP_S = 0.0  # hivemind's default waits for other initial peers and a lookup of our own id
STOP_S = 5.0
SYNC_CALL_S = 60.0  # a call without return_future waits at most this (Membership always asks for a future)


def _reexports(init_path: str, package: str) -> dict[str, str]:
    """Name -> absolute module of every ``from X import name`` in a package's ``__init__.py``."""
    with open(init_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), init_path)
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            module = node.module if node.level == 0 else importlib.util.resolve_name(
                "." * node.level + node.module, package)
            for alias in node.names:
                names[alias.asname or alias.name] = module
    return names


def _lazy_package(name: str, directory: str) -> types.ModuleType:
    init_path = os.path.join(directory, "__init__.py")
    exports = _reexports(init_path, name)
    module = types.ModuleType(name)
    module.__path__ = [directory]
    module.__file__ = init_path
    module.__package__ = name

    def __getattr__(attr: str) -> Any:  # PEP 562: a re-exported name, imported on first use
        source = exports.get(attr)
        if source is None:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(source), attr)
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def light_hivemind() -> bool:
    """Make hivemind's DHT importable without torch; False (nothing changed) if hivemind is already loaded
    or not where we expect it."""
    if "hivemind" in sys.modules:
        return False
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    for name in LAZY_PACKAGES:
        directory = os.path.join(root, *name.split(".")[1:])
        if not os.path.isfile(os.path.join(directory, "__init__.py")):
            return False
    for name in LAZY_PACKAGES:
        sys.modules[name] = _lazy_package(name, os.path.join(root, *name.split(".")[1:]))
    return True


@dataclass(slots=True)
class ReaderSettings:
    initial_peers: list[str]
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    start_timeout_s: float = 30.0
    process_group: int | None = None  # p2pd joins it (the watchdog's), like the DHT process's p2pd


class LightDHT:
    """A client-mode DHTNode on its own event-loop thread in this process; see the module docstring."""

    def __init__(self, settings: ReaderSettings, validators: list[Any]):
        self.settings = settings
        self._validators = validators
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="light-dht", daemon=True)
        self._node: Any = None

    def start(self) -> LightDHT:
        """Start the node; raises what ``DHTNode.create`` raised, or TimeoutError."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._create(), self._loop)
        try:
            self._node = future.result(timeout=self.settings.start_timeout_s)
        except BaseException:
            future.cancel()
            self.shutdown()
            raise
        return self

    async def _create(self) -> Any:
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        from swarm.dht.dht import NODE_TUNING, _apply_hivemind_fixes

        _apply_hivemind_fixes()
        with _p2pd_in_group(self.settings.process_group):
            return await DHTNode.create(
                initial_peers=self.settings.initial_peers, host_maddrs=self.settings.host_maddrs, client_mode=True,
                record_validator=CompositeValidator(self._validators), bootstrap_timeout=READER_BOOTSTRAP_S,
                **NODE_TUNING,
            )

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(self._node.get(key, latest=latest, **kwargs), self._loop)
        return future if return_future else future.result(SYNC_CALL_S)

    def shutdown(self) -> None:
        """Stop the node and p2pd, then the loop; idempotent."""
        if self._node is not None and self._loop.is_running():
            node, self._node = self._node, None
            try:
                asyncio.run_coroutine_threadsafe(node.shutdown(), self._loop).result(timeout=STOP_S)
            except Exception as exc:  # p2pd may be gone already; the watchdog's group holds what is left
                logger.debug("stopping the reader's DHT node: %s", exc)
        if self._loop.is_running():  # hivemind's background tasks (routing refresh, ...): cancelled, not left pending
            try:
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(timeout=STOP_S)
            except Exception as exc:
                logger.debug("cancelling the DHT node's tasks: %s", exc)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join(STOP_S)


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def start_reader(settings: ReaderSettings, validators: list[Any]) -> LightDHT:
    """Start a LightDHT; raise swarm.dht.dht.DHTStartError with advice (as start_dht does) when it fails."""
    from swarm.dht.dht import DHTStartError, explain_start_failure

    try:
        return LightDHT(settings, validators).start()
    except TimeoutError:
        raise DHTStartError(f"could not reach the DHT within {settings.start_timeout_s:.0f} s; check that a "
                            "bootstrap peer is running at the address given") from None
    except Exception as exc:  # hivemind raises plain exceptions for bootstrap failures
        raise DHTStartError(explain_start_failure(exc, settings.initial_peers)) from None


class _p2pd_in_group:
    """While DHTNode.create spawns p2pd, make the spawn put it in ``group`` (Popen's ``process_group``)."""

    def __init__(self, group: int | None):
        self.group = group
        self._original: Any = None

    def __enter__(self) -> None:
        if self.group is None or sys.version_info < (3, 11):
            return
        import asyncio.subprocess as aio_subprocess

        original = self._original = aio_subprocess.create_subprocess_exec
        group = self.group

        async def spawn_in_group(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("process_group", group)
            return await original(*args, **kwargs)

        aio_subprocess.create_subprocess_exec = spawn_in_group  # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        if self._original is not None:
            import asyncio.subprocess as aio_subprocess

            aio_subprocess.create_subprocess_exec = self._original  # type: ignore[assignment]
