"""CPU workarounds for SGLang 0.5.23 PD that are not flags (engine side only).

The real-engine harness puts this directory first on the engines' ``PYTHONPATH``, so every
SGLang process (the HTTP server, the tokenizer manager, the scheduler subprocesses) runs this
module at start-up. It applies:

1. **Prefill sender on CPU.** ``MooncakeKVSender.supports_host_tensor_indices`` is ``True`` in
   ``sglang/srt/disaggregation/mooncake/conn.py``; with it, the prefill
   (``disaggregation/prefill.py``, ``send_kv_chunk``) copies the page indices into *pinned*
   memory and records a ``torch.cuda.Event``, which fails without CUDA. Set to ``False`` right
   after that module is imported, the prefill computes the page indices on the host
   (``kv_to_page_indices``), which is what the non-CUDA path is for.
2. **torchvision stand-in hidden from availability checks.** ``importlib.util.find_spec`` answers
   None for ``torchvision`` when it resolves to our stand-in (a file under this directory), so
   transformers (``is_torchvision_available``) does not try to use it; ``import torchvision``
   itself still works for SGLang's module-level imports.

The other two CPU-PD bugs are handled by the harness with environment and flags, not here: a
radix-cache hit on the prefill creates ``torch.cuda.Event`` in the early send of cached prefixes
(``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``), and the decode's default retraction
backup pool calls ``cudaHostRegister`` (``--disaggregation-decode-retraction-backup cpu_tensor``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_STUBS_DIR = Path(__file__).resolve().parent
_MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"


def _patch_mooncake_conn(module: types.ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


_POST_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {_MOONCAKE_CONN: _patch_mooncake_conn}


class _PatchingLoader(importlib.abc.Loader):
    """Wraps a module's real loader and applies its patch after the module body has run."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders, then wraps their loaders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _POST_IMPORT.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_real_find_spec = importlib.util.find_spec


def _find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
    spec = _real_find_spec(name, package)
    if spec is not None and name.split(".")[0] == "torchvision":
        origin = Path(spec.origin) if spec.origin else None
        if origin is None or _STUBS_DIR in origin.parents:
            return None  # our import-only stand-in: report torchvision absent
    return spec


sys.meta_path.insert(0, _PostImportFinder())
importlib.util.find_spec = _find_spec
