"""Open a metadata store by URL.

* ``memory://`` - a fresh in-process ``MemoryStore`` (tests, ``scroll standalone`` experiments).
* ``etcd://host:port[/namespace]`` or ``http://host:port[/namespace]`` - an ``EtcdStore``.
"""

from __future__ import annotations

from fragments.store import MetadataStore


async def open_store(url: str, *, timeout: float = 5.0) -> MetadataStore:
    """The store for ``url``; ``MetadataUnavailable`` (naming the URL) if etcd does not answer."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        from fragments.memstore import MemoryStore

        return MemoryStore()
    if scheme in ("etcd", "http"):
        from fragments.etcdstore import EtcdStore

        return await EtcdStore.connect(url, timeout=timeout)
    raise ValueError(f"unknown metadata store URL {url!r} (expected memory://, etcd://host:port or http://host:port)")
