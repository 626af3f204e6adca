"""One simulated rank traces at a time: TensorFlow's graph building is not safe for threads.

The in-process world (des_ops.comm.InProcessWorld) runs every simulated rank in a thread of one
process. Five ranks tracing their ``fit`` at once once crashed the suite inside TensorFlow
(a segmentation fault in ``op_def_library._GetOpDef`` while other threads built gradient
graphs). So every ``FuncGraph`` a rank thread builds (a ``tf.function``'s trace, ``cond`` and
``while`` branches, ``wrap_function``) is built holding its world's :class:`TraceToken`.

The token never causes a hang: a rank gives it back whenever it waits for the other ranks in a
collective (``TraceToken.released``), so a trace that meets a collective eagerly lets the others
trace on; and waiting for the token times out with the rank holding it named.

    >>> token = TraceToken(timeout=5.0)
    >>> with token.held(1), token.held(1):        # re-entrant for one rank (nested traces)
    ...     with token.released(1):               # waiting in a collective: rank 0 may trace
    ...         with token.held(0):
    ...             pass
    ...     token.owner
    1
    >>> token.owner is None
    True
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_current = threading.local()        # .token, .rank: the world and rank a thread runs as
_patch_lock = threading.Lock()
_patched = False


class TraceToken:
    """Held by at most one rank at a time; re-entrant for that rank."""

    def __init__(self, timeout: float = 300.0) -> None:
        self._cond = threading.Condition()
        self._timeout = timeout
        self.owner: int | None = None
        self._depth = 0
        self._aborted = False

    def _acquire(self, rank: int, depth: int = 1) -> None:
        with self._cond:
            if self.owner == rank:
                self._depth += depth
                return
            if not self._cond.wait_for(lambda: self.owner is None or self._aborted, timeout=self._timeout):
                raise TimeoutError(f"rank {rank}: waited {self._timeout:.0f} s to trace while rank "
                                   f"{self.owner} traced")
            if self._aborted:
                raise RuntimeError(f"rank {rank}: another simulated rank failed")
            self.owner, self._depth = rank, depth

    def _release(self, rank: int, depth: int = 1) -> None:
        with self._cond:
            assert self.owner == rank, (self.owner, rank)
            self._depth -= depth
            if self._depth == 0:
                self.owner = None
                self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, rank: int) -> Iterator[None]:
        """Hold the token (wait for it) while the block runs."""
        self._acquire(rank)
        try:
            yield
        finally:
            self._release(rank)

    @contextlib.contextmanager
    def released(self, rank: int) -> Iterator[None]:
        """Give the token back while the block runs, if ``rank`` holds it; take it again after."""
        with self._cond:
            depth = self._depth if self.owner == rank else 0
        if not depth:
            yield
            return
        self._release(rank, depth)
        try:
            yield
        finally:
            self._acquire(rank, depth)

    def abort(self) -> None:
        """Wake every rank waiting for the token with an error (a rank failed)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


@contextlib.contextmanager
def running_as(token: TraceToken, rank: int) -> Iterator[None]:
    """This thread is simulated rank ``rank``: the graphs it builds are built holding ``token``."""
    _install()
    _current.token, _current.rank = token, rank
    try:
        yield
    finally:
        _current.token = _current.rank = None


def _install() -> None:
    """Wrap TensorFlow's one function that builds a FuncGraph from Python (every caller looks it
    up in its module at call time). Threads that run as no rank build as before."""
    global _patched
    with _patch_lock:
        if _patched:
            return
        from tensorflow.python.framework import func_graph as func_graph_module
        build = func_graph_module.func_graph_from_py_func

        def func_graph_from_py_func(*args, **kwargs):
            token = getattr(_current, "token", None)
            if token is None:
                return build(*args, **kwargs)
            with token.held(_current.rank):
                return build(*args, **kwargs)

        func_graph_module.func_graph_from_py_func = func_graph_from_py_func
        _patched = True
