"""A Prometheus metrics endpoint whose thread sleeps until someone connects.

How this works. ``prometheus_client.start_http_server`` runs ``serve_forever()``, which polls its
listening socket every 0.5 s (to notice ``shutdown()``): two wake-ups a second in every process
that serves metrics, for nothing, when nobody scrapes. ``serve_metrics(port, host, registry)``
serves the same WSGI app (``make_wsgi_app``: the same text format, ``?name[]=`` filtering,
gzip) on a ``ThreadingWSGIServer``, but its thread blocks in ``select`` with no timeout on two
things: the listening socket (a connection: one request handled, in a thread of its own as
before) and one end of a socket pair that ``shutdown()`` writes to. So an idle endpoint costs no
wake-up at all, and ``shutdown()`` still returns at once (it wakes the thread and joins it).

It lives in ``fragments`` so the bookie, the streams tools and the Kafka listener can all use it.
"""

from __future__ import annotations

import selectors
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["MetricsServer", "serve_metrics"]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """No line per scrape on stderr (prometheus_client's handler does the same)."""


class MetricsServer:
    """A running endpoint: ``server_port``, ``shutdown()`` (stop serving, join the thread) and
    ``server_close()`` (close the listening socket), like the ``WSGIServer`` that
    ``start_http_server`` returns."""

    def __init__(self, port: int, host: str, registry: CollectorRegistry):
        class Server(ThreadingWSGIServer):  # the address family of host (an IPv6 address works too)
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        self._httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
        # non-blocking: a connection reset between select and accept must not park the thread in
        # accept (handle_request then finds nothing to accept and returns)
        self._httpd.socket.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"metrics-http-{self.server_port}", daemon=True)
        self._thread.start()

    @property
    def server_port(self) -> int:
        return self._httpd.server_port

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._httpd.socket, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                ready = sel.select()  # no timeout: asleep until a connection or shutdown()
                if self._stopping:
                    break
                if any(key.fileobj is self._httpd.socket for key, _ in ready):
                    # the socket is readable: handle_request accepts at once and hands the
                    # connection to a thread of its own (ThreadingMixIn)
                    self._httpd.handle_request()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop serving (requests in flight finish in their own threads) and wait for the thread."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def server_close(self) -> None:
        self.shutdown()
        self._httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()


def serve_metrics(port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``registry`` (default: prometheus_client's global one) on ``host:port`` from a thread
    that blocks until a connection comes (``port`` 0: any free port; see ``server_port``)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    return MetricsServer(port, host, registry)
