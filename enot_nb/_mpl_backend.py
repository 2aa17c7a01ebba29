"""A matplotlib backend for workers: ``plt.show()`` sends each figure to the notebook as PNG.

Selected in every worker of a distributed cell (``MPLBACKEND=module://enot_nb._mpl_backend``),
so plots work the same whether the worker was forked from the kernel or spawned.
"""

from __future__ import annotations

import base64
from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def publish_figure(figure: Any) -> None:
    """Send one figure to the notebook as image/png (through the worker's display publisher)."""
    from IPython.core.interactiveshell import InteractiveShell

    from enot_nb._cell import figure_png

    png = figure_png(figure)
    InteractiveShell.instance().display_pub.publish(
        data={"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(figure)},
        metadata={},
    )


def show(*args: Any, **kwargs: Any) -> None:
    for manager in Gcf.get_all_fig_managers():
        publish_figure(manager.canvas.figure)
    Gcf.destroy_all()
