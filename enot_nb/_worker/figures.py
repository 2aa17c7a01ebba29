"""Figures of a worker as PNG display data (the worker's display publisher sends them on)."""

from __future__ import annotations

import base64
import io
from typing import Any


def figure_png(figure: Any) -> bytes:
    """A figure as PNG bytes, cropped as the inline backend crops it."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def publish_figure(figure: Any) -> None:
    """Send one figure to the notebook as image/png (through the worker's display publisher)."""
    from IPython.core.interactiveshell import InteractiveShell

    png = figure_png(figure)
    InteractiveShell.instance().display_pub.publish(
        data={"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(figure)},
        metadata={},
    )
