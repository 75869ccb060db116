"""``scroll console``: serve the web console of a cluster (``scroll standalone`` starts one by default).

It needs the metadata URL; ``--bootstrap`` names a Kafka listener (live consumer group members,
offset resets, group deletes; ``--command-config`` gives its client settings when it is secured);
``--metrics NAME=URL`` (repeatable) names the /metrics endpoints whose samples make the graphs:
``standalone``, ``kafka`` or a bookie id (``bookie-0``). ``--secure`` serves HTTPS (``--ssl-cert``,
``--ssl-key``) and requires a login; without it the console refuses any address but loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import signal
import ssl
import sys

import click

from fragments import aioloop

log = logging.getLogger("scroll.console")
DEFAULT_PORT = 9400
READY = "scroll console serving"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_sources(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, url = item.partition("=")
        if not eq or not name or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"NAME=http://host:port/metrics, not {item!r}", param_hint="--metrics")
        out[name.strip()] = url.strip()
    return out


async def serve(metadata_url: str, host: str, port: int, *, bootstrap: str | None = None, kafka_security=None,
                sources: dict[str, str] | None = None, secure: bool = False, ssl_cert: str | None = None,
                ssl_key: str | None = None, token: str | None = None, super_users=frozenset(),
                bookie_security=None, sample_interval_s: float = 10.0) -> None:
    import uvicorn

    from fragments.tlsreload import ReloadableServerContext
    from streams.client import connect

    from .app import build_app
    from .auth import Auth
    from .data import ConsoleData
    from .timeseries import Sampler

    client = await connect(metadata_url, security=bookie_security)
    try:
        data = ConsoleData(client, bootstrap, kafka_security)
        auth = Auth(client.cluster.store, secure=secure, token=token, super_users=frozenset(super_users))
        sampler = Sampler(sources or {}, interval_s=sample_interval_s)
        app = build_app(data, auth, sampler, scheme="https" if secure else "http")
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                                ssl_certfile=ssl_cert, ssl_keyfile=ssl_key, date_header=False)
        config.load()
        tls = None
        if secure:
            def build() -> ssl.SSLContext:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(ssl_cert, ssl_key)
                return ctx

            tls = ReloadableServerContext(build, "console", ssl_cert)
            config.ssl = tls.context  # every handshake goes through it: SIGHUP re-reads the files
        server = _quiet_server_class()(config)
        loop = asyncio.get_running_loop()
        if tls is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, tls.reload)
        scheme = "https" if secure else "http"
        log.info("%s on %s://%s:%d", READY, scheme, host, port)
        await server.serve()
    finally:
        await client.close()


@functools.cache
def _quiet_server_class():
    import uvicorn  # (imported when serving: the CLI's other commands start faster)

    class QuietServer(uvicorn.Server):
        """uvicorn's server without its tick: ``main_loop`` wakes every 0.1 s to refresh the Date
        header and look for an exit request (ten wake-ups a second, most of an idle console's CPU).
        This one sleeps until a signal asks it to exit; the console sends no Date header."""

        async def main_loop(self) -> None:
            self._exit = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            if not self.should_exit:
                await self._exit.wait()

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)  # (a signal handler: wake the loop thread-safely)
            loop, event = getattr(self, "_loop", None), getattr(self, "_exit", None)
            if loop is not None and event is not None:
                loop.call_soon_threadsafe(event.set)

    return QuietServer


@click.command("console")
@click.option("--metadata", "metadata_url", required=True, envvar="SCROLL_METADATA",
              help="metadata store URL, e.g. etcd://127.0.0.1:2379 (or SCROLL_METADATA)")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (anything but loopback needs --secure)")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option("--bootstrap", default=None, help="a Kafka listener, host:port (groups' members, resets, deletes)")
@click.option("--command-config", default=None, type=click.Path(dir_okay=False, exists=True),
              envvar="SCROLL_KAFKA_COMMAND_CONFIG",
              help="Kafka client properties to reach --bootstrap (security.protocol, sasl.*, ssl.ca.location)")
@click.option("--metrics", "metrics", multiple=True, metavar="NAME=URL",
              help="a /metrics endpoint to sample for the graphs (repeatable): standalone=..., kafka=..., bookie-0=...")
@click.option("--sample-interval", default=10.0, show_default=True, type=click.FloatRange(0.5, 600.0),
              help="seconds between samples (the graphs keep the last 360)")
@click.option("--secure", is_flag=True, help="HTTPS, a login (a Kafka SCRAM user or the token), Kafka ACLs, CSRF")
@click.option("--ssl-cert", default=None, type=click.Path(dir_okay=False, exists=True), help="PEM certificate chain")
@click.option("--ssl-key", default=None, type=click.Path(dir_okay=False, exists=True), help="PEM key of --ssl-cert")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="a file holding a login token (logs in as User:console)")
@click.option("--super-users", default="", help="principals allowed everything, e.g. 'User:admin;User:console'")
def console_command(metadata_url: str, host: str, port: int, bootstrap: str | None, command_config: str | None,
                    metrics: tuple[str, ...], sample_interval: float, secure: bool, ssl_cert: str | None,
                    ssl_key: str | None, token_file: str | None, super_users: str) -> None:
    """Serve the web console: cluster health, streams and their fragment chains, records,
    consumer groups and lag, bookies.

    \b
      scroll console --metadata etcd://127.0.0.1:2379 --bootstrap 127.0.0.1:9092
      scroll console --secure --ssl-cert c.pem --ssl-key k.pem --host 0.0.0.0 ...
    """
    from ..security.acls import parse_super_users

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if secure:
        if not (ssl_cert and ssl_key):
            raise click.BadParameter("--secure needs --ssl-cert and --ssl-key", param_hint="--secure")
    else:
        if not _loopback(host):
            raise click.BadParameter(f"without --secure the console serves loopback only, not {host}",
                                     param_hint="--host")
        if ssl_cert or ssl_key or token_file:
            raise click.BadParameter("--ssl-cert, --ssl-key and --token-file need --secure")
    kafka_security = None
    if command_config:
        from ..security.client_security import KafkaClientConfig

        try:
            kafka_security = KafkaClientConfig.from_properties(command_config)
        except Exception as exc:  # noqa: BLE001 - shown as a usage error
            raise click.BadParameter(str(exc), param_hint="--command-config") from None
    token = None
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if len(token) < 16:
            raise click.BadParameter("the token must be at least 16 characters", param_hint="--token-file")
    try:
        users = parse_super_users(super_users)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--super-users") from None
    from ..cli.main import _bookie_security

    sources = parse_sources(metrics)
    scheme = "https" if secure else "http"
    click.echo(f"{READY} on {scheme}://{host}:{port}/" + ("" if secure else "  (no login: loopback only)"))
    sys.stdout.flush()
    aioloop.run(serve(metadata_url, host, port, bootstrap=bootstrap, kafka_security=kafka_security,
                      sources=sources, secure=secure, ssl_cert=ssl_cert, ssl_key=ssl_key, token=token,
                      super_users=users, bookie_security=_bookie_security(), sample_interval_s=sample_interval))
