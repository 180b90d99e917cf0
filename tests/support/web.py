"""The tests' one-off HTTP calls: httpx's functions, sharing one TLS context.

Each `httpx.get()` builds a client and, with it, a TLS context that parses the whole CA bundle: ~50 ms of
CPU per call, even to an http:// URL. The tests poll managers every 20 ms while they start, which made this
the largest cost of the pytest processes. Same signatures as httpx's functions; a test that sends many
requests keeps an `httpx.Client` instead.
"""

from __future__ import annotations

import ssl
from functools import partial

import httpx

_TLS = ssl.create_default_context()

request = partial(httpx.request, verify=_TLS)
stream = partial(httpx.stream, verify=_TLS)
get = partial(httpx.get, verify=_TLS)
options = partial(httpx.options, verify=_TLS)
post = partial(httpx.post, verify=_TLS)
put = partial(httpx.put, verify=_TLS)
patch = partial(httpx.patch, verify=_TLS)
delete = partial(httpx.delete, verify=_TLS)
