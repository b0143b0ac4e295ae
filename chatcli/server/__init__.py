"""``chatcli serve``: an OpenAI-compatible HTTP server over chatcli's persistent conversations.

Two layers, kept apart:

- the service (``history``, ``index``, ``service``): message lists → conversations, the prefix index,
  the resident conversations. It imports no HTTP code and is driven by plain calls and iterators;
- the HTTP layer (``app``, ``schemas``, ``errors``, ``run``): Starlette routes, request validation,
  OpenAI-style error objects, authentication, limits, SSE and the per-request log line.
"""
