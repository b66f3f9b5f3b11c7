"""agent: answers questions with a plan/act loop over the tools and a grounded answer."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="agent",
    default_port=50050,
    description="Agent: plan, call tools in parallel, answer with citations",
    setup="services.agent.servicer:setup",
    options="services.agent.settings:AgentSettings",
    # A run mostly waits on tools and generation.
    max_concurrency=32,
    # Cancel and GetRun must reach the agent while every slot is busy.
    exempt_methods=(
        "/aimesh.agent.v1.AgentService/Cancel",
        "/aimesh.agent.v1.AgentService/GetRun",
    ),
    dependencies=("tools", "generation"),
    edge_services=("aimesh.agent.v1.AgentService",),
    callers=(("aimesh.agent.v1.AgentService", (EDGE, OPERATOR)),),
    scopes=(("aimesh.agent.v1.AgentService", "generate"),),
)
