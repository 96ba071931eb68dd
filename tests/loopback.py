"""One HTTP client for the tests' requests to the servers they start on loopback.

httpx's module-level calls (`httpx.get`) each build a client, and with it an SSL context that loads the CA
bundle: tens of milliseconds of CPU a call, for hundreds of calls, many in loops that wait for an event. Like
those calls, this client keeps no connection alive: each request opens its own connection, so a test that
counts connections, drains them or restarts a server sees what a new client would."""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
