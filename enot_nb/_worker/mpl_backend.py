"""A matplotlib backend for workers: ``plt.show()`` sends each figure to the notebook as PNG.

Selected in every worker of a distributed cell (``MPLBACKEND=module://enot_nb._worker.mpl_backend``),
so plots work the same whether the worker was forked from the kernel or spawned.
"""

from __future__ import annotations

from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from enot_nb._worker.figures import publish_figure

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    for manager in Gcf.get_all_fig_managers():
        publish_figure(manager.canvas.figure)
    Gcf.destroy_all()
