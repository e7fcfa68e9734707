"""Progress of long builds: a tqdm bar, log lines, or a callback of your own.

The build kernels report after each update round through a hook in the extension
(csrc/core/progress.h), with how many pool entries the round changed and, from the second outer
iteration of a build from scratch on, the share of a sample of rows that a search of the graph so
far does not find: the build stops once a round changes few entries and an outer iteration no
longer makes many rows findable (:class:`~torch_grnnd.BuildParams`, ``delta``), so the reports
show it converging. ``progress`` arguments accept:

- ``False`` (default): no reports, and no cost.
- ``True``: a tqdm bar when tqdm is installed, else one ``INFO`` record per round on the
  ``"torch_grnnd"`` logger (``logging.basicConfig(level=logging.INFO)`` shows them).
- a callable ``progress(done, total)``, ``progress(done, total, changes)`` or
  ``progress(done, total, changes, unfound)``: the rounds done, the most the build may run
  (``outer_iters * inner_iters``; equal to ``done`` in the last report of a build that converged
  early), the pool entries the round changed, and the last measured unfound share (``None``
  before the first measure, and in builds that take none: ``delta=0`` or a start from ``init``).
  Raising from it stops the build and the exception propagates.

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
from typing import Callable, Iterator, Optional, Tuple, TypeVar, Union

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

        def log(done: int, total: int, changes: int, unfound: Optional[float] = None) -> None:
            logger.info("%s: round %d of at most %d done after %.2f s, %d pool entries changed%s", what, done, total,
                        time.perf_counter() - start, changes,
                        "" if unfound is None else f", {unfound:.3f} of the sampled rows unfound")

        return log, lambda: None

    bar = tqdm(desc=f"torch_grnnd {what}", unit="round", leave=False)

    def update(done: int, total: int, changes: int, unfound: Optional[float] = None) -> None:
        bar.total = total  # known from the first report on; shrinks when the build converges
        if unfound is None:
            bar.set_postfix(changed=changes, refresh=False)
        else:
            bar.set_postfix(changed=changes, unfound=f"{unfound:.3f}", refresh=False)
        bar.update(done - bar.n)

    return update, bar.close


def _arguments(fn: Callable[..., None]) -> int:
    """How many of (done, total, changes, unfound) a user's callback takes: 2, 3 or 4."""
    for count in (4, 3):
        try:
            inspect.signature(fn).bind(*range(count))
            return count
        except (TypeError, ValueError):
            continue
    return 2


def _user_reporter(fn: Callable[..., None]) -> Callable[[int, int, int, Optional[float]], None]:
    """``report(done, total, changes, unfound)`` calling ``fn`` with the arguments it takes."""
    count = _arguments(fn)
    if count == 4:
        return fn
    if count == 3:
        return lambda done, total, changes, _unfound: fn(done, total, changes)
    return lambda done, total, _changes, _unfound: fn(done, total)


def steps_reporter(progress: Progress, what: str) -> Tuple[Callable[[int, int], None], Callable[[], None]]:
    """``(report(done, total), close)`` for a job that counts steps of its own (rows built, say)
    rather than build rounds; ``changes`` is 0 for callbacks that take it."""
    if not progress:
        return (lambda done, total: None), (lambda: None)
    if callable(progress):
        report = _user_reporter(progress)
        return (lambda done, total: report(done, total, 0, None)), (lambda: None)
    report, close = _default_reporter(what)
    return (lambda done, total: report(done, total, 0, None)), close


@contextlib.contextmanager
def reporting(progress: Progress, what: str = "build") -> Iterator[None]:
    """Within the block, builds on this thread report to ``progress`` (see the module doc)."""
    if not progress:
        yield
        return
    if callable(progress):
        report = _user_reporter(progress)
        close = lambda: None  # noqa: E731
    else:
        report, close = _default_reporter(what)
    raised = []

    def callback(done: int, total: int, changes: int, unfound: float) -> None:
        try:
            report(done, total, changes, None if unfound < 0 else unfound)
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
