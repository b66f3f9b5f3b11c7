"""The client a request is for: `x-aimesh-client`, set by the edge from the API key it
checked, carried on across every hop like the request id.

Per-client state deeper in the mesh (the tools' idempotency keys) is scoped by it, so a
service in the middle (the agent) must pass it on; doing that here, in the interceptors,
means no service can forget to. Calls that arrive without it (inside the mesh, tests)
belong to the anonymous client "".
"""

from __future__ import annotations

from contextvars import ContextVar

import grpc

from mesh.rpc import incoming

METADATA_KEY = "x-aimesh-client"
_MAX_LENGTH = 128
# The end user a request is for, within its client (the OpenAI `user` field): what the
# generation router's canary splits users by. Only the router reads it, so it is not
# carried on. Metadata is printable ASCII: the gateway percent-encodes what is not, and
# a 128-character user, each character 4 UTF-8 bytes percent-encoded, fits this bound.
USER_METADATA_KEY = "x-aimesh-user"
MAX_USER_BYTES = 128 * 12

_client: ContextVar[str] = ContextVar("aimesh_client", default="")


def current() -> str:
    return _client.get()


def adopt(context: grpc.aio.ServicerContext) -> None:
    """Takes the client from the call's metadata for this call's task; the interceptors
    send it on (mesh.rpc.carried)."""
    _client.set(incoming(context, METADATA_KEY, _MAX_LENGTH) or "")


def act_for(client: str) -> None:
    """Makes `client` this task's client outside a call of its own (a run another replica
    started, resumed here, goes on for the client that started it)."""
    _client.set(client)
