"""The link between a decode engine (`serving.api.disagg.DisaggregatedEngine`) and its prefill side: a duplex
`multiprocessing.connection` connection, a pipe to a prefill process of this host or an authenticated TCP socket
to a prefill server on another (`jaxseek serve --role prefill`, `serving.api.prefill_server`).

Messages are pickled tuples. The decode side sends ("hello", settings, split, model config) first (a prefill
server only), then ("add", id, prompt, params, constraint, trigger), ("cancel", id) and ("stop",); the prefill
side answers ("ready", (layout, weight bytes)) or ("failed", why), then ("accepted", id), ("error", (id, why)),
("cancelled", id), ("finished", RequestOutput) and ("handoff", SlotState). Pickles run code when read, so a TCP
link is opened only with the shared secret of `$JAXSEEK_PD_KEY` (HMAC challenge of `multiprocessing.connection`);
TCP keep-alive probes end a link whose peer host vanished without closing it.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from multiprocessing.connection import Client, Connection

KEY_ENV = "JAXSEEK_PD_KEY"
CONNECT_SECONDS = 30.0  # how long a decode engine waits for a prefill server to take its link
# keep-alive: idle seconds before the first probe, seconds between probes, probes unanswered before the link ends
KEEP_ALIVE = (10, 5, 3)


def link_key() -> bytes:
    """The shared secret both sides of a TCP link authenticate with; raises ValueError when it is not set."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise ValueError(f"a prefill server's link is authenticated: set ${KEY_ENV} to the same secret on the "
                         "prefill and the decode host")
    return key.encode()


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port); raises ValueError naming what is wrong."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a prefill server address must be HOST:PORT with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


def keep_alive(link: Connection) -> None:
    """Turn on TCP keep-alive probes for a socket link, so a peer that vanished ends it within about 25 s."""
    sock = socket.fromfd(link.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a duplicate: options are shared
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, count = KEEP_ALIVE
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
            if hasattr(socket, name):  # Linux; other systems keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()


def connect(address: str, timeout: float = CONNECT_SECONDS) -> Connection:
    """An authenticated link to the prefill server at `address`, within `timeout` seconds (`Client` itself waits
    as long as the host's TCP stack and the peer let it); raises RuntimeError saying why there is none."""
    host, port = parse_address(address)
    key = link_key()
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["link"] = Client((host, port), authkey=key)
        except Exception as e:
            outcome["error"] = e

    opening = threading.Thread(target=attempt, daemon=True, name="prefill-connect")
    opening.start()
    opening.join(timeout)
    if opening.is_alive():  # a late link finds no hello and the prefill server drops it
        raise RuntimeError(f"no prefill server took the link at {address} within {timeout:g} s")
    error = outcome.get("error")
    if isinstance(error, OSError):
        raise RuntimeError(f"no prefill server answers at {address}: {error}") from error
    if error is not None:  # multiprocessing.AuthenticationError and the like
        raise RuntimeError(f"the prefill server at {address} refused the link ({type(error).__name__}: {error}): "
                           f"is ${KEY_ENV} the same on both hosts?") from error
    link = outcome["link"]
    keep_alive(link)
    return link


class Inbox:
    """The messages arriving on `link`, read by a thread of their own so the other side never waits to send while
    this side sends (a hand-off can be larger than a socket's buffer); the end of the link reads as ("stop",)."""

    def __init__(self, link: Connection):
        self.link, self.messages = link, queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(link,), daemon=True, name="prefill-inbox")
        self.reader.start()

    def _read(self, link: Connection) -> None:
        while True:
            try:
                self.messages.put(link.recv())
            except (EOFError, OSError):
                self.messages.put(("stop",))
                return

    def get(self, block: bool) -> tuple | None:
        """The next message (waiting for one if `block`); None if none is there."""
        try:
            return self.messages.get(block=block)
        except queue.Empty:
            return None

    def close(self) -> None:
        """End the link: shut its socket down (which wakes the reader), wait for the reader, close it."""
        sock = socket.fromfd(self.link.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the peer had already gone
            pass
        finally:
            sock.close()
        self.reader.join()
        self.link.close()
