"""`pagefleet.Client` and `pagefleet.AsyncClient`: talk to a running `pagefleet serve`.

The clients live with the server in `router/client.py`; this module is their public name.
"""

from router.client import AsyncClient, Client, Completion, build_request

__all__ = ["AsyncClient", "Client", "Completion", "build_request"]
