"""Acting on a module when a script imports it, without importing it ourselves.

    after_import("torch", lambda torch: torch.set_num_threads(1))

Some of portddp's settings belong to libraries a job may never load -- torch's thread count
in a JAX-only job, torch.distributed.checkpoint's DDP check -- and importing one just to set
it costs every rank its import time (torch: ~1 s).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = ["after_import"]


def after_import(name: str, then) -> None:
    """Call `then(module)` now if module `name` is imported, else once its first import has run it."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == name:
            finder.actions.append(then)
            return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs its actions on module `name` once the module has been executed, the first time it is imported."""

    def __init__(self, name: str, then):
        self.name, self.actions = name, [then]

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # (once; and the lookup below must not find this finder again)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for then in self.actions:
                    then(module)

            spec.loader.exec_module = exec_module
        return spec
