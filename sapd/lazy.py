"""A module imported at its first use (``lazy_module``). The config, which every door and every pod
loads, needs the objectives' registry (:mod:`sapd.method.objective`) but not their tensors; importing torch
there cost every process that never computes one (``sapd.jobs.wait``, most of ``sapd``'s commands) about
3 s of CPU at start."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable


class _LazyModule:
    """Stands for the module ``load()`` imports: the first attribute read calls it (then each read is a
    lookup in that module)."""

    def __init__(self, load: Callable[[], ModuleType]) -> None:
        self._load = load
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = self._load()
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module ({'imported' if self._module is not None else 'not imported yet'})>"


def lazy_module(load: Callable[[], ModuleType]) -> Any:
    """A stand-in for the module that ``load`` imports (a function with an ``import`` statement, which the
    layer rules read like any import), importing it at the first attribute read. Declare the real module for
    the type checker::

        if TYPE_CHECKING:
            import torch
        else:
            def _import_torch(): import torch; return torch
            torch = lazy_module(_import_torch)
    """
    return _LazyModule(load)
