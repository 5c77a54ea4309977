"""Where the command line's output goes: the report, progress, and the libraries' own chatter.

A report is read in a terminal or in a log (CI, a job's stdout file). For a log it must read as
cleanly: no progress-bar frames, tables never cut to 80 columns, the verdict last. And it must not
drown in what megatron-core, torch and gloo print while the engine runs (gloo's ``[Gloo] Rank 0 is
connected to ...`` from C++, megatron-core's deprecation banner, warnings): those go to a log file
in ``$TMPDIR``, unless ``--verbose`` asks for them inline. A run that passes removes it (``--keep-log``
keeps it); after a failure or an error it is kept and the output names it (:func:`settle_log`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from rich.console import Console

# Width for a stream that is not a terminal: wide enough that no table is ever cut or folded
# (rich tables take their natural width, not this one), so a log never shows "cach…" headers.
LOG_WIDTH = 100_000


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes and closed streams)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def report_console(width: Optional[int] = None, file: Optional[TextIO] = None) -> Console:
    """A rich console for a report on ``file`` (default: stdout).

    Args:
        width: columns; ``None`` means the terminal's width, or :data:`LOG_WIDTH` when the stream
            is not a terminal (tables at their natural width, lines never wrapped).
        file: the stream; ``None`` is ``sys.stdout`` at the time of each print.
    """
    stream = file if file is not None else sys.stdout
    if width is None and not is_terminal(stream):
        width = LOG_WIDTH
    return Console(file=file, width=width)


@dataclass
class LibraryOutput:
    """What the libraries printed during a run.

    Attributes:
        path: the log file holding it (``None`` when shown inline, ``--verbose``).
        stdout: the real standard output while the run lasts (the libraries' is the log).
        stderr: the real standard error while the run lasts.
    """

    path: Optional[Path]
    stdout: TextIO
    stderr: TextIO

    def lines(self) -> int:
        """Number of lines in the log file (0 when inline or empty)."""
        return 0 if self.path is None else _line_count(self.path)

    def settle(self, passed: bool, keep: bool = False) -> Optional[str]:
        """Remove or keep the log once the command's outcome is known (:func:`settle_log`)."""
        return settle_log(self.path, "passed" if passed else "failed", keep)


def _line_count(path: Path) -> int:
    try:
        with path.open("rb") as handle:
            return sum(1 for _ in handle)
    except OSError:  # removed meanwhile, or unreadable: nothing to name
        return 0


#: Why a log is kept, by outcome (:func:`settle_log`).
_KEPT_BECAUSE = {"failed": "kept: the run failed", "error": "kept: the command stopped with an error"}


def settle_log(path: Optional[Path], outcome: str, keep: bool = False) -> Optional[str]:
    """Remove a command's library log or keep it, and say where it is.

    A passing run leaves nothing in ``$TMPDIR``: its log is removed, unless ``keep`` (``--keep-log``).
    After a failure (``outcome`` ``"failed"``: the verdict was not PASS) or an error (``"error"``:
    an exception or Ctrl-C stopped the command) the log is kept, since it is where megatron-core's
    own messages are, and named; an empty one is removed (nothing to read).

    Args:
        path: the log file; ``None`` (shown inline, ``--verbose``) does nothing.
        outcome: ``"passed"``, ``"failed"`` or ``"error"``.
        keep: keep it (and name it) whatever the outcome, even empty.

    Returns:
        The report line naming the kept log, or ``None`` when it was removed (or there was none).
    """
    if path is None:
        return None
    count = _line_count(path)
    if keep:
        why = "kept by --keep-log"
    elif outcome == "passed" or count == 0:
        path.unlink(missing_ok=True)
        return None
    else:
        why = _KEPT_BECAUSE[outcome]
    return f"megatron-core / torch / gloo output: {count} lines in {path} ({why}; --verbose shows it inline)"


def log_path(command: str, rank: int) -> Path:
    """The log file of one command on one rank, in the temporary directory (``$TMPDIR``)."""
    suffix = f"-rank{rank}" if rank else ""
    return Path(tempfile.gettempdir()) / f"megatron-ext-{command}-{os.getpid()}{suffix}.log"


@contextlib.contextmanager
def library_output(path: Optional[Path]) -> Iterator[LibraryOutput]:
    """Send everything written to file descriptors 1 and 2 inside the block to ``path``.

    File descriptors, not ``sys.stdout``: gloo writes from C++, below Python. The yielded object's
    ``stdout`` / ``stderr`` stay on the real streams for progress lines. Errors raised inside the
    block leave it first, so their message and traceback reach the real stderr in full.

    Args:
        path: the log file (created, truncated); ``None`` diverts nothing (nor does a process
            without file descriptors 1 and 2).
    """
    saved: dict[int, int] = {}
    try:
        for fd in (1, 2) if path is not None else ():
            saved[fd] = os.dup(fd)
    except OSError:  # no file descriptor 1 or 2 (a daemon): nothing to divert
        for copy in saved.values():
            os.close(copy)
        saved = {}
    if not saved:
        yield LibraryOutput(None, sys.stdout, sys.stderr)
        return
    try:
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        for copy in saved.values():
            os.close(copy)
        from .errors import MegatronExtError

        raise MegatronExtError(f"cannot write the library log {path} ({exc.strerror}); set TMPDIR to a "
                               "writable directory, or pass --verbose") from None
    sys.stdout.flush()
    sys.stderr.flush()
    real_out = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    real_err = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        yield LibraryOutput(path, real_out, real_err)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(log_fd)
        real_out.close()
        real_err.close()


def _importing(frame: Any) -> bool:
    """Whether ``frame`` (or a caller of it) runs inside the import machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class CtrlC:
    """Ctrl-C that reaches the command even when a library swallows it.

    megatron-core wraps optional imports (zmq, msgpack, tqdm, cuda bindings) in bare ``except:``,
    so a KeyboardInterrupt raised while a module imports can be lost and the run goes on; raised
    inside an extension's own start-up code it also makes Python kill itself with SIGINT at exit
    (exit -2, not 130). So a press while a module is importing is only remembered, and
    :meth:`check` (called after every engine step, and by ``main`` when the command returns)
    raises it; a press anywhere else raises KeyboardInterrupt at once, as Python's handler does.
    """

    pressed = False

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[None]:
        """The handler inside the block, the previous one after it (a no-op off the main thread,
        where ``signal.signal`` cannot be called)."""
        cls.pressed = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, cls._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @classmethod
    def _handler(cls, _signum: int, frame: Any) -> None:
        cls.pressed = True
        if not _importing(frame):
            raise KeyboardInterrupt

    @classmethod
    def check(cls) -> None:
        """Raises: KeyboardInterrupt if Ctrl-C was pressed inside :meth:`installed`."""
        if cls.pressed:
            raise KeyboardInterrupt


class RunProgress:
    """Progress of the engine runs of ``ab`` / ``soak``.

    On a terminal, a progress bar of engine steps (tqdm) on stderr; elsewhere, one line per
    finished run on stdout (``<case>: <run>: N engine steps, S s``), so a log has no bar frames.
    Silent when ``enabled`` is false (``--no-progress``, ranks other than 0).
    """

    def __init__(self, case_name: str, output: LibraryOutput, enabled: bool = True):
        self.case_name = case_name
        self.output = output
        self.enabled = enabled
        self.bar = None
        if enabled and is_terminal(output.stderr):
            from tqdm import tqdm

            self.bar = tqdm(desc=f"{case_name}: engine steps", unit="step", leave=False,
                            file=output.stderr)

    def on_step(self, _step: int) -> None:
        """Called after every engine step of every run; re-raises a swallowed Ctrl-C."""
        CtrlC.check()
        if self.bar is not None:
            self.bar.update(1)

    def on_run(self, run: Any) -> None:
        """Called with each finished run (a :class:`megatron_ext.harness.step_loop.RunRecord`)."""
        if self.enabled and self.bar is None:
            print(f"{self.case_name}: {run.label}: {run.steps} engine steps, {run.wall_s:.1f} s",
                  file=self.output.stdout, flush=True)

    def close(self) -> None:
        """Remove the bar (no-op without one)."""
        if self.bar is not None:
            self.bar.close()

