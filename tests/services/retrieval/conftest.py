"""Retrieval fixtures' shared part: an embedder and a retrieval server on 127.0.0.1, the
store in a folder of the test's."""

from __future__ import annotations

from pathlib import Path

from mesh.config import MeshSettings, ServiceSettings
from mesh.server import MeshServer
from services.embedder.servicer import setup as embedder_setup
from services.retrieval.servicer import setup as retrieval_setup


async def start_retrieval(store: Path) -> tuple[MeshServer, MeshServer]:
    """(embedder, retrieval), both started; the caller drains them."""
    cache = MeshSettings().cache_dir
    # Two threads: while these tests ingest, the embedder has the machine's cores to itself
    # (1000 stdlib passages embedded in 15 s instead of 26 with the default one thread).
    embedder_settings = MeshSettings(cache_dir=cache, engines={"embedder": {"threads": 2}})
    embedder = MeshServer("embedder", embedder_settings, port=0, default_max_concurrency=32)
    await embedder_setup(embedder)
    await embedder.start()
    settings = MeshSettings(
        cache_dir=cache,
        services={"retrieval": ServiceSettings(max_concurrency=16)},
        engines={"retrieval": {"path": str(store), "embedder": f"127.0.0.1:{embedder.port}"}},
    )
    retrieval = MeshServer("retrieval", settings, port=0)
    await retrieval_setup(retrieval)
    await retrieval.start()
    return embedder, retrieval
