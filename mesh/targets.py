"""gRPC target strings (`host:port`, `dns:///host:port`, `ipv4:a:p,b:p`) and the
addresses they name: one parser for Envoy's config and for allow-lists of peers."""

from __future__ import annotations

import asyncio
import ipaddress
import socket


def host_port(address: str) -> tuple[str, int]:
    """'10.0.0.5:50062' -> ('10.0.0.5', 50062); '[::1]:1' -> ('::1', 1)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def endpoints(target: str) -> tuple[bool, list[tuple[str, int]]]:
    """Whether the target's hosts are DNS names, and its (host, port) list."""
    if target.startswith("dns:"):
        return True, [host_port(target.removeprefix("dns:").lstrip("/"))]
    if target.startswith(("ipv4:", "ipv6:")):
        return False, [host_port(address) for address in target.split(":", 1)[1].split(",")]
    host, port = host_port(target)
    return not is_ip(host), [(host, port)]


async def resolve(target: str) -> set[tuple[str, int]]:
    """Every (ip, port) the target names now; a DNS name that does not resolve names none."""
    named, pairs = endpoints(target)
    if not named:
        return set(pairs)
    loop = asyncio.get_running_loop()
    found: set[tuple[str, int]] = set()
    for host, port in pairs:
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found.update((str(info[4][0]), port) for info in infos)
    return found
