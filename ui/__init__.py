"""rill's page: the Gradio Blocks chat and the status panel (`build_demo`).

app.py mounts it with `gr.mount_gradio_app(app, demo, path="/", **ui.MOUNT_KWARGS)`: since
Gradio 6, page CSS is given at mount time, not to `gr.Blocks`; so is `mcp_server`.
"""

from ui.mcp_tools import mcp_available
from ui.page import CSS, build_demo
from ui.queue_polling import slow_queue_polling

# mcp_server: Gradio's MCP server at /gradio_api/mcp/ (tools: ui/mcp_tools.py), when `mcp` is installed
MOUNT_KWARGS = {"css": CSS, "mcp_server": mcp_available()}

__all__ = ["CSS", "MOUNT_KWARGS", "build_demo", "slow_queue_polling"]
