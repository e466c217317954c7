"""rill's page: the Gradio Blocks chat and the status panel (`build_demo`)."""

from ui.page import build_demo

__all__ = ["build_demo"]
