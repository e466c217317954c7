"""rill's page: the Gradio Blocks chat and the status panel (`build_demo`).

app.py mounts it with `gr.mount_gradio_app(app, demo, path="/", **ui.MOUNT_KWARGS)`: since
Gradio 6, page CSS is given at mount time, not to `gr.Blocks`.
"""

from ui.page import CSS, build_demo
from ui.queue_polling import slow_queue_polling

MOUNT_KWARGS = {"css": CSS}

__all__ = ["CSS", "MOUNT_KWARGS", "build_demo", "slow_queue_polling"]
