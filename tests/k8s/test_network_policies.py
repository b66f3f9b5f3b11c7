"""The rendered NetworkPolicies (strictly validated with everything else, tests/k8s/
conftest.py): every pod denied by default, and between the mesh's pods exactly the call
graph the services declare, no more and no less."""

from __future__ import annotations

import pytest

from mesh.authz import EDGE
from mesh.registry import discover
from tests.k8s.conftest import Doc, containers, of_kind, pod_spec, workloads

pytestmark = pytest.mark.system

SPECS = discover()
APP = "app.kubernetes.io/name"
# Anyone: the edge's listener (no `from`), or every pod of the namespace.
WORLD, NAMESPACE_PODS, SCRAPERS = "<anyone>", "<any pod>", "<scrapers>"


def selects(policy: Doc, labels: dict[str, str]) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    return wanted.items() <= labels.items()


def sources(rule: Doc) -> set[str]:
    if "from" not in rule:
        return {WORLD}
    found = set()
    for peer in rule["from"]:
        pods = peer.get("podSelector", {}).get("matchLabels", {})
        if "namespaceSelector" in peer:
            assert pods == {"aimesh/metrics-scraper": "true"}, peer  # nothing else crosses
            found.add(SCRAPERS)
        elif not pods:
            found.add(NAMESPACE_PODS)
        else:
            found.add(pods[APP])
    return found


def allowed(docs: list[Doc]) -> set[tuple[str, str, str]]:
    """(source, workload, port name) for every connection some policy allows."""
    edges = set()
    for name, workload in workloads(docs).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for policy in of_kind(docs, "NetworkPolicy").values():
            if not selects(policy, labels):
                continue
            for rule in policy["spec"].get("ingress", []):
                for source in sources(rule):
                    edges.update((source, name, port["port"]) for port in rule["ports"])
    return edges


def test_every_pod_is_denied_unless_a_policy_allows(overlay):
    (deny,) = [
        p
        for p in of_kind(overlay, "NetworkPolicy").values()
        if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
    ]
    assert deny["spec"]["policyTypes"] == ["Ingress"]
    reached = {target for _, target, _ in allowed(overlay)}
    assert reached == set(workloads(overlay)), "a workload no policy lets anything reach"


def test_the_mesh_services_grpc_ports_allow_exactly_the_call_graph(overlay, deployed):
    """Service to service: a caller reaches a callee's gRPC port iff it declares the
    callee a dependency (the edge iff the callee serves the edge); the gateway's HTTP API
    from the edge only; metrics ports from scrapers only."""
    edges = allowed(overlay)
    expected = {
        (caller.name, callee, "grpc")
        for caller in SPECS.values()
        for callee in caller.dependencies
        if caller.name in deployed and callee in deployed
    }
    expected |= {(EDGE, name, "grpc") for name in deployed if SPECS[name].edge_services}
    expected |= {(EDGE, name, "http") for name in deployed if SPECS[name].edge_http_paths}
    mesh_edges = {
        (source, target, port)
        for source, target, port in edges
        if target in deployed and port in ("grpc", "http")
    }
    assert mesh_edges == expected
    assert {s for s, t, p in edges if p == "metrics"} <= {SCRAPERS}


def test_the_outside_reaches_only_the_edge_and_qdrant_only_retrieval(overlay):
    edges = allowed(overlay)
    assert {(t, p) for s, t, p in edges if s == WORLD} == {("edge", "http")}
    assert {s for s, t, p in edges if t == "qdrant" and p in ("http", "grpc")} == {
        "retrieval",
        SCRAPERS,
    }
    assert {s for s, t, p in edges if p == "p2p"} == {"qdrant"}
    if "triton" in workloads(overlay):
        callers = {s for s, t, p in edges if t == "triton" and p == "grpc"}
        pointed = {
            name
            for name, w in workloads(overlay).items()
            if any(
                "triton" in str(env.get("value", ""))
                for c in pod_spec(w)["containers"]
                for env in c.get("env", [])
            )
        }
        assert callers == pointed - {"triton"}


def test_redis_is_reachable_only_from_the_pods_given_its_password(overlay):
    """The shared state's Redis: from the edge, the gateway, the generation router and the
    agent (the pods that keep state there: the ones its Secret's password is given to),
    from nobody else, on no other port."""
    password = {"secretKeyRef": {"name": "aimesh-redis", "key": "password"}}
    given = {
        name
        for name, workload in workloads(overlay).items()
        if name != "redis"
        for container in containers(workload)
        if any(entry.get("valueFrom") == password for entry in container.get("env", []))
    }
    assert given == {"edge", "gateway", "generation", "agent"}
    assert {(s, p) for s, t, p in allowed(overlay) if t == "redis"} == {(s, "redis") for s in given}
