"""Is a host on this machine? The one loopback test of the server (which refuses to listen
elsewhere without an API key) and the clients (which show server-side timings only from there)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address: a server there is on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
