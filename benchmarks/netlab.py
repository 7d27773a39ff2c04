"""A network lab: N hosts as network namespaces on a private bridge, each with its link's rate and delay.

Used by tests (tests/test_netlab.py) and benchmarks (benchmarks/wan.py). Needs root and `ip`/`tc`;
`lab_unavailable()` says why a lab cannot run here, so tests skip with that reason.

    with Lab([Link(rate_mbit_s=20, delay_ms=25)] * 3) as lab:
        proc = lab.popen(lab.hosts[0], ["python", "-c", "..."])

Layout: a bridge `vl<pid><k>b` with 10.77.S.1/24 in this (the root) namespace; host i is the
namespace `vlab-<pid>-<k>-h<i>` with address 10.77.S.(i+2) on its `eth0`, a veth whose other end
`vl<pid><k><i>` sits on the bridge. Nothing routes out of 10.77.S.0/24: the namespaces have no default
route and this namespace does not forward.

Behind NAT (``Link(nat=True)``): 10.77.S.(i+2) belongs to a router namespace `vlab-<pid>-<k>-r<i>`, and the
host sits behind it on a LAN of its own, 10.78.i.2/24 (``Host.address``; ``Host.public_address`` is the
router's). The router masquerades the host's connections (nftables, hence Debian's `nftables` package:
``nat_unavailable()``) and forwards nothing in, like a home router without a port forward: the host
dials anyone, nobody dials it.

Rate: a `tbf` qdisc on both ends of the host's veth (the namespace end shapes its upload, the bridge end
its download), so a transfer between two hosts runs at the slower host's rate.

Delay: this kernel has no `netem`, so latency is added above TCP by a delaying relay
(benchmarks/netlab_relay.py) that runs in this process: `lab.expose(host, port)` returns the relay's
address on the bridge, which a volunteer announces (`network.announce`) while it listens on its own
address. Every chunk through the relay leaves `delay_ms` of the dialled host plus `delay_ms` of the
dialling host after it arrived, in both directions, so a request and its reply between hosts A and B
take 2 x (delay_A + delay_B) more: `Link.for_rtt(rate, rtt_ms)` sets a profile's round trip between two
such hosts. The relay terminates TCP on each side (a split-TCP proxy): applications see the round trip,
but TCP's own congestion window does not (slow start and loss recovery run over the short hops).

Teardown on every exit path: `close()` (the context manager) kills the processes started in the lab's
namespaces, stops the relay and deletes the namespaces, veths and bridge; it also runs at exit
(atexit) and on SIGTERM/SIGHUP (then the previous handler runs). A lab whose process was SIGKILLed is
found by the pid in its names and removed when the next lab starts (`remove_stale_labs`).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netlab_relay import DelayRelay

NS_PREFIX = "vlab-"
NETNS_EXEC = ("ip", "netns", "exec")


def netns_of(prefix: list[str] | tuple[str, ...]) -> str | None:
    """The network namespace a host's ``exec_prefix`` runs its command in, None for any other prefix (a process
    forked there joins it itself: volunteer_cli/forkserver_process.py)."""
    prefix = tuple(prefix)
    return prefix[3] if len(prefix) == 4 and prefix[:3] == NETNS_EXEC else None
NS_RE = re.compile(r"^vlab-(\d+)-([a-z])-[hr]\d+$")  # hosts, and the NAT routers of hosts behind NAT
LINK_RE = re.compile(r"^vl(\d+)([a-z])(b|\d+)$")
SUBNET_BASE = "10.77"
LAN_BASE = "10.78"  # behind NAT: host i has 10.78.i.2 on its router's LAN, inside the router's namespace only
CMD_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
TBF_QUEUE_MS = 50  # how long a packet may wait in the shaper's queue (a home router's buffer)
TBF_MIN_BURST_BYTES = 32 * 1024
MAX_LABS_PER_PROCESS = 26


class LabError(RuntimeError):
    """The lab could not be built or torn down; the message says which command failed and why."""


@dataclass(frozen=True, slots=True)
class Link:
    """One host's access link: its rate each way (0 = unlimited) and the one-way delay it adds. ``nat``: the
    host sits behind a NAT router (a home router without a port forward): it dials out, nobody dials in."""

    rate_mbit_s: float = 0.0
    delay_ms: float = 0.0
    nat: bool = False

    @classmethod
    def for_rtt(cls, rate_mbit_s: float, rtt_ms: float) -> Link:
        """A link whose round trip to a host with the same link is rtt_ms (through the relay)."""
        return cls(rate_mbit_s=rate_mbit_s, delay_ms=rtt_ms / 4.0)

    def __post_init__(self):
        if self.rate_mbit_s < 0 or self.delay_ms < 0:
            raise ValueError(f"a link's rate_mbit_s and delay_ms must be >= 0, not {self}")


@dataclass(frozen=True, slots=True)
class Host:
    index: int
    netns: str
    address: str  # its own address: 10.77.S.(index + 2), or 10.78.index.2 behind NAT
    link: Link
    public_address: str = ""  # what other hosts see it as: address, or its NAT router's 10.77.S.(index + 2)

    def exec_prefix(self) -> list[str]:
        """Put before a command to run it inside this host (``netns_of`` reads the namespace back)."""
        return [*NETNS_EXEC, self.netns]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"


def nat_unavailable() -> str | None:
    """Why hosts behind NAT cannot be built here (None: they can): a lab, and nftables' `nft`."""
    reason = lab_unavailable()
    if reason is None and shutil.which("nft") is None:
        reason = "hosts behind NAT need `nft` (Debian's nftables package; .ci/run installs it)"
    return reason


def lab_unavailable() -> str | None:
    """Why a lab cannot run here (None: it can): tests skip with this reason."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veths, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (iproute2)"
    probe = f"{NS_PREFIX}{os.getpid()}-z-h0"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"`{' '.join(argv)}` took over {CMD_TIMEOUT_S:.0f} s") from exc
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _kill_netns_pids(netns: str) -> None:
    for word in _sh("ip", "netns", "pids", netns, check=False).stdout.split():
        try:
            os.kill(int(word), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            continue


def remove_stale_labs() -> list[str]:
    """Delete the namespaces and links of labs whose process is gone (a SIGKILLed test, say); their names."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NS_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _kill_netns_pids(name)
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = LINK_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> int:
    """A third octet S whose 10.77.S.0/24 no interface here uses."""
    used = set()
    for line in _sh("ip", "-4", "-o", "addr", "show", check=False).stdout.splitlines():
        for word in line.split():
            if word.startswith(f"{SUBNET_BASE}."):
                used.add(int(word.split(".")[2]))
    start = os.getpid() % 200 + 1
    for offset in range(250):
        candidate = (start + offset) % 250 + 1
        if candidate not in used:
            return candidate
    raise LabError(f"every {SUBNET_BASE}.S.0/24 is in use here; remove stale labs (`ip netns list`)")


def tbf_args(rate_mbit_s: float) -> list[str]:
    """tc arguments of a token bucket at this rate: a burst of at least 4 ms of the rate (tbf needs at
    least rate/HZ) and a queue of TBF_QUEUE_MS."""
    rate_bytes_s = rate_mbit_s * 1e6 / 8
    burst_bytes = max(TBF_MIN_BURST_BYTES, int(rate_bytes_s * 0.004))
    return ["tbf", "rate", f"{rate_mbit_s}mbit", "burst", str(burst_bytes), "latency", f"{TBF_QUEUE_MS}ms"]


_LABS: list[Lab] = []
_LABS_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _close_all() -> None:
    for lab in list(_LABS):
        lab.close()


def _install_exit_hooks() -> None:
    """atexit, and SIGTERM/SIGHUP handlers that tear the labs down, then do what was there before."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _close_all()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


class Lab:
    """N hosts on one bridge. Build it with ``with Lab(links) as lab`` (or ``start()`` / ``close()``)."""

    def __init__(self, links: list[Link]):
        if not links:
            raise ValueError("a lab needs at least one host")
        self.links = list(links)
        self.hosts: list[Host] = []
        self.bridge = ""
        self.gateway = ""  # the bridge's address: where the relays listen
        self._tag = ""
        self._procs: list[subprocess.Popen] = []
        self._relay: DelayRelay | None = None
        self._closed = False

    # ----- life cycle

    def start(self) -> Lab:
        remove_stale_labs()
        _install_exit_hooks()
        with _LABS_LOCK:
            taken = {lab._tag for lab in _LABS}
            free = [chr(97 + k) for k in range(MAX_LABS_PER_PROCESS) if chr(97 + k) not in taken]
            if not free:
                raise LabError(f"more than {MAX_LABS_PER_PROCESS} labs at once in one process")
            self._tag = free[0]
            _LABS.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        pid = os.getpid()
        subnet = _free_subnet()
        network = ipaddress.ip_network(f"{SUBNET_BASE}.{subnet}.0/24")
        self.gateway = str(network[1])
        self.bridge = f"vl{pid}{self._tag}b"
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for index, link in enumerate(self.links):
            public = str(network[index + 2])
            netns = f"{NS_PREFIX}{pid}-{self._tag}-h{index}"
            if link.nat:
                host = Host(index, netns, f"{LAN_BASE}.{index}.2", link, public_address=public)
                self._add_host(host, f"vl{pid}{self._tag}{index}", on_bridge=f"{NS_PREFIX}{pid}-{self._tag}-r{index}",
                               address=public)
                self._add_nat(host, router=f"{NS_PREFIX}{pid}-{self._tag}-r{index}")
            else:
                host = Host(index, netns, public, link, public_address=public)
                self._add_host(host, f"vl{pid}{self._tag}{index}")
            self.hosts.append(host)
        self._relay = DelayRelay(self.gateway, {h.public_address: h.link.delay_ms for h in self.hosts})
        self._relay.start()

    def _add_host(self, host: Host, veth: str, on_bridge: str = "", address: str = "") -> None:
        """The namespace on the bridge (the host's own, or its NAT router's: on_bridge), with its link."""
        ns = on_bridge or host.netns
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", veth, "master", self.bridge, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{address or host.address}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if host.link.rate_mbit_s > 0:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf_args(host.link.rate_mbit_s))
            _sh("tc", "qdisc", "add", "dev", veth, "root", *tbf_args(host.link.rate_mbit_s))

    def _add_nat(self, host: Host, router: str) -> None:
        """host behind router: a LAN veth between them, the router forwarding and masquerading the LAN's
        connections out of its eth0 (nftables), and nothing forwarded in: a home router without a port
        forward. Connections from outside reach the router itself, where nothing listens."""
        lan = f"{LAN_BASE}.{host.index}"
        _sh("ip", "netns", "add", host.netns)
        _sh("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _sh("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _sh("ip", "-n", router, "link", "set", "lan0", "up")
        _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        _sh("ip", "-n", host.netns, "route", "add", "default", "via", f"{lan}.1")
        _sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = "\n".join([
            "table ip nat {", "  chain postrouting {", "    type nat hook postrouting priority 100;",
            f'    oifname "eth0" ip saddr {lan}.0/24 masquerade', "  }", "}",
            "table ip filter {", "  chain forward {", "    type filter hook forward priority 0; policy drop;",
            "    ct state established,related accept", '    iifname "lan0" accept', "  }", "}", ""])
        done = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True,
                              text=True, timeout=CMD_TIMEOUT_S)
        if done.returncode != 0:
            raise LabError(f"nft in {router} exited {done.returncode}: {done.stderr.strip()}")

    def close(self) -> None:
        """Idempotent: processes, relay, namespaces, links. Raises nothing; says what it could not remove."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _stop(proc)
        if self._relay is not None:
            self._relay.stop()
        pid = os.getpid()
        for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"{NS_PREFIX}{pid}-{self._tag}-"):
                _kill_netns_pids(name)
                _sh("ip", "netns", "del", name, check=False)
        for index in range(len(self.links)):
            _sh("ip", "link", "del", f"vl{pid}{self._tag}{index}", check=False)
        if self.bridge:
            _sh("ip", "link", "del", self.bridge, check=False)
        with _LABS_LOCK:
            if self in _LABS:
                _LABS.remove(self)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- using it

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start argv inside host (its own session); the lab kills it at close if it still runs."""
        proc = subprocess.Popen([*host.exec_prefix(), *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run argv inside host to its end (text output captured); LabError if it fails or overruns."""
        try:
            done = subprocess.run([*host.exec_prefix(), *argv], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"{argv[:3]} in {host.netns} took over {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            raise LabError(f"{argv[:3]} in {host.netns} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
        return done

    def expose(self, host: Host, port: int) -> str:
        """The multiaddr of a relay on the bridge to host:port that adds the links' delays; announce it."""
        assert self._relay is not None, "start the lab first"
        if host.link.nat:
            raise LabError(f"host {host.index} is behind NAT: nothing outside can dial it, so nothing to expose")
        relay_port = self._relay.forward(host.address, port)
        return f"/ip4/{self.gateway}/tcp/{relay_port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(STOP_TIMEOUT_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)
