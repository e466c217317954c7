"""rill's HTTP edge: `/chat` (SSE), the OpenAI-compatible `/v1`, health; see server/app.py."""

from server.app import create_app
from frontend.settings import Settings

__all__ = ["Settings", "create_app"]
