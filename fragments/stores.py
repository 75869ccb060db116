"""Open a metadata store by URL.

* ``memory://`` - a fresh in-process ``MemoryStore`` (tests, ``scroll standalone`` experiments).
* ``etcd://[user:password@]host:port[,host:port...][/namespace]`` or ``http://...`` - an ``EtcdStore``
  (several members: fail-over between them, docs/metadata.md);
  ``etcds://`` (or ``https://``) for TLS, with ``?ca=/path&cert=/path&key=/path`` PEM files.
  ``security`` (``ClientSecurity``) overrides the URL's user/password and TLS files.
"""

from __future__ import annotations

from fragments.security import ClientSecurity, redact_url
from fragments.store import MetadataStore


async def open_store(url: str, *, security: ClientSecurity | None = None, timeout: float = 5.0) -> MetadataStore:
    """The store for ``url``; ``MetadataUnavailable`` (naming the URL, password redacted) if etcd
    does not answer, ``MetadataAuthError`` if it refuses the credentials or the TLS handshake."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        from fragments.memstore import MemoryStore

        return MemoryStore()
    if scheme in ("etcd", "http", "etcds", "https"):
        from fragments.etcdstore import EtcdStore

        return await EtcdStore.connect(url, timeout=timeout, security=security)
    raise ValueError(f"unknown metadata store URL {redact_url(url)!r} "
                     "(expected memory://, etcd://host:port, etcds://host:port or http://host:port)")
