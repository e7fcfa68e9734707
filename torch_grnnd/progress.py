"""Progress of long builds: a tqdm bar, log lines, or a callback of your own.

The build kernels report after each outer iteration (``T1`` reports per build) through a hook in
the extension (csrc/progress.h). ``progress`` arguments accept:

- ``False`` (default): no reports, and no cost.
- ``True``: a tqdm bar when tqdm is installed, else one ``INFO`` record per outer iteration on
  the ``"torch_grnnd"`` logger (``logging.basicConfig(level=logging.INFO)`` shows them).
- a callable ``progress(done, total)``: called with the outer iterations done and their total.
  Raising from it stops the build and the exception propagates.

On CUDA a report waits for the iteration to finish (one stream synchronisation per outer
iteration); inside ``torch.compile`` progress is ignored, so compiled code never syncs for it.

Example:
    >>> import torch, torch_grnnd as grnnd
    >>> seen = []
    >>> graph = grnnd.build(torch.randn(500, 8), outer_iters=2,
    ...                     progress=lambda done, total: seen.append((done, total)))
    >>> seen
    [(1, 2), (2, 2)]
"""
import contextlib
import logging
import time
from typing import Callable, Iterator, TypeVar, Union

import torch

from . import _C

logger = logging.getLogger(__name__)  # under "torch_grnnd"

Progress = Union[bool, Callable[[int, int], None]]
T = TypeVar("T")


def run_reporting(progress: Progress, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, with the builds it runs reporting to ``progress``; plain ``fn()`` inside
    ``torch.compile``, where the host-side hook cannot be traced."""
    if not progress or torch.compiler.is_compiling():
        return fn()
    with reporting(progress, what):
        return fn()


def _default_reporter(what: str):
    """``(report, close)``: a tqdm bar if tqdm is importable, else log records."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        start = time.perf_counter()

        def log(done: int, total: int) -> None:
            logger.info("%s: outer iteration %d of %d done after %.2f s", what, done, total,
                        time.perf_counter() - start)

        return log, lambda: None

    bar = tqdm(desc=f"torch_grnnd {what}", unit="iter", leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total  # known from the first report on
        bar.update(done - bar.n)

    return update, bar.close


@contextlib.contextmanager
def reporting(progress: Progress, what: str = "build") -> Iterator[None]:
    """Within the block, builds on this thread report to ``progress`` (see the module doc)."""
    if not progress:
        yield
        return
    report, close = (progress, lambda: None) if callable(progress) else _default_reporter(what)
    raised = []

    def callback(done: int, total: int) -> None:
        try:
            report(done, total)
        except BaseException as error:
            raised.append(error)  # re-raised below, in place of the kernel's RuntimeError
            raise

    _C._set_progress_callback(callback)
    try:
        yield
    except RuntimeError as error:
        if raised:
            raise raised[0] from error
        raise
    finally:
        _C._set_progress_callback(None)
        close()
