"""The files a command writes besides its report (``--json``, ``--plot``, ``--dump-case``),
checked before it runs, so a long run's results are not lost to a bad path at the end."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Mapping, Optional

from ..errors import MegatronExtError


class OutputPathError(MegatronExtError):
    """An output file cannot be written: its path is a directory, its directory is missing or
    not writable, or ``--plot`` cannot be honoured (no matplotlib, a format it does not write)."""


def check_output_files(outputs: Mapping[str, Optional[str]]) -> None:
    """Check that every given output file can be written, and that ``--plot`` can be drawn.

    Args:
        outputs: flag -> path, e.g. ``{"--json": "out.json", "--plot": None}``; a ``None`` path is
            not given.

    Raises:
        OutputPathError: naming the flag, the path and the fix.
    """
    for flag, path in outputs.items():
        if path is not None:
            _check_writable(flag, path)
    if outputs.get("--plot"):
        _check_plot(outputs["--plot"])


def _check_writable(flag: str, path: str) -> None:
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise OutputPathError(f"{flag} {path} is a directory; pass a file path")
    directory = target.parent
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise OutputPathError(f"{flag} {path}: directory {directory} does not exist or is "
                              "not writable; create it or choose another path")


def _check_plot(plot: str) -> None:
    """matplotlib is installed and writes the format ``plot``'s suffix names."""
    if importlib.util.find_spec("matplotlib") is None:
        raise OutputPathError("--plot needs matplotlib, which is not installed; "
                              "pip install 'megatron-ext[plot]' (or leave out --plot)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(plot).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise OutputPathError(f"--plot {plot}: matplotlib writes {', '.join(sorted(formats))}, not "
                              f"'{suffix or '(no extension)'}'; name the file e.g. delta.png")
