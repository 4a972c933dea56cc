"""Acting on a module when a script imports it, without importing it ourselves.

    after_import("torch", lambda torch: torch.set_num_threads(1))

Some of portddp's settings belong to modules a job may never load -- torch's thread count in a
JAX-only job, torch.distributed.checkpoint's DDP check, TorchDynamo's graph breaks -- and
importing one just to set it costs every rank its import time (torch: ~1 s).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading

__all__ = ["after_import"]

_log = logging.getLogger("portddp")
_lock = threading.Lock()


def after_import(name: str, then) -> None:
    """Call `then(module)` now if module `name` is imported, else once its first import has run it
    (a lookup alone, `importlib.util.find_spec(name)`, does not count; an import that fails does
    not either: the next one will). An error in `then` is logged, never raised into the import."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            for finder in sys.meta_path:
                if isinstance(finder, _AfterImport) and finder.name == name:
                    finder.actions.append(then)
                    return
            sys.meta_path.insert(0, _AfterImport(name, then))
            return
    _run(then, module)


def _run(then, module) -> None:
    try:
        then(module)
    except Exception:  # (a setting that cannot be applied must not break the script's import)
        _log.exception("portddp: applying a setting to %s failed", module.__name__)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs its actions on module `name` once an import has executed it, then leaves sys.meta_path."""

    def __init__(self, name: str, then):
        self.name, self.actions = name, [then]
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(self._finding, "on", False):
            return None
        self._finding.on = True  # (the lookup below must not find this finder again)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.on = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)  # (if it raises, the import fails and this finder waits for the next one)
                self._done(module)

            spec.loader.exec_module = exec_module
        return spec

    def _done(self, module) -> None:
        with _lock:
            if self not in sys.meta_path:  # (already done)
                return
            sys.meta_path.remove(self)
            actions = list(self.actions)
        for then in actions:
            _run(then, module)
