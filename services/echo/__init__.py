"""echo: the mesh's conformance and demo service (no model)."""

from mesh.authz import ANYONE
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="echo",
    default_port=50100,
    description="conformance and demo service for the mesh runtime",
    setup="services.echo.servicer:setup",
    diagnostic=True,
    # A diagnostic: any certificate of the mesh's CA may use it.
    callers=(("aimesh.echo.v1.EchoService", (ANYONE,)),),
)
