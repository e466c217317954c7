"""What the HTTP routes (server/) and the page (ui/) share, below both and above the engine:
the one admission path (`admission.py`), the engine backends (local, Ray, a remote OpenAI server),
the settings record, request metrics, tool-call parsers and the errors a client can act on."""
