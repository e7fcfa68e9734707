"""Progress of long builds: a tqdm bar, log lines, or a callback of your own.

The build kernels report after each update round through a hook in the extension
(csrc/core/progress.h), with how many pool entries the round changed: the build stops once that
falls below ``delta * N * pool_size`` (:class:`~torch_grnnd.BuildParams`), so the reports show
it converging. ``progress`` arguments accept:

- ``False`` (default): no reports, and no cost.
- ``True``: a tqdm bar when tqdm is installed, else one ``INFO`` record per round on the
  ``"torch_grnnd"`` logger (``logging.basicConfig(level=logging.INFO)`` shows them).
- a callable ``progress(done, total)`` or ``progress(done, total, changes)``: the rounds done,
  the most the build may run (``outer_iters * inner_iters``; equal to ``done`` in the last report
  of a build that converged early) and the pool entries the round changed. Raising from it
  stops the build and the exception propagates.

On CUDA a report waits for the round to finish (one stream synchronisation); inside
``torch.compile`` progress is ignored, so compiled code never syncs for it.

Example:
    >>> import torch, torch_grnnd as grnnd
    >>> seen = []
    >>> graph = grnnd.build(torch.randn(500, 8), outer_iters=2, inner_iters=2, delta=0,
    ...                     progress=lambda done, total: seen.append((done, total)))
    >>> seen
    [(1, 4), (2, 4), (3, 4), (4, 4)]
"""
import contextlib
import inspect
import logging
import time
from typing import Callable, Iterator, Tuple, TypeVar, Union

import torch

from . import _C

logger = logging.getLogger(__name__)  # under "torch_grnnd"

Progress = Union[bool, Callable[..., None]]
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

        def log(done: int, total: int, changes: int) -> None:
            logger.info("%s: round %d of at most %d done after %.2f s, %d pool entries changed", what, done, total,
                        time.perf_counter() - start, changes)

        return log, lambda: None

    bar = tqdm(desc=f"torch_grnnd {what}", unit="round", leave=False)

    def update(done: int, total: int, changes: int) -> None:
        bar.total = total  # known from the first report on; shrinks when the build converges
        bar.set_postfix(changed=changes, refresh=False)
        bar.update(done - bar.n)

    return update, bar.close


def _takes_changes(fn: Callable[..., None]) -> bool:
    """Whether a user's callback takes the third argument, ``changes``."""
    try:
        inspect.signature(fn).bind(0, 0, 0)
        return True
    except (TypeError, ValueError):
        return False


def steps_reporter(progress: Progress, what: str) -> Tuple[Callable[[int, int], None], Callable[[], None]]:
    """``(report(done, total), close)`` for a job that counts steps of its own (rows built, say)
    rather than build rounds; ``changes`` is 0 for callbacks that take it."""
    if not progress:
        return (lambda done, total: None), (lambda: None)
    if callable(progress):
        report = progress if _takes_changes(progress) else (lambda done, total, _changes: progress(done, total))
        return (lambda done, total: report(done, total, 0)), (lambda: None)
    report, close = _default_reporter(what)
    return (lambda done, total: report(done, total, 0)), close


@contextlib.contextmanager
def reporting(progress: Progress, what: str = "build") -> Iterator[None]:
    """Within the block, builds on this thread report to ``progress`` (see the module doc)."""
    if not progress:
        yield
        return
    if callable(progress):
        user = progress
        report = user if _takes_changes(user) else (lambda done, total, _changes: user(done, total))
        close = lambda: None  # noqa: E731
    else:
        report, close = _default_reporter(what)
    raised = []

    def callback(done: int, total: int, changes: int) -> None:
        try:
            report(done, total, changes)
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
