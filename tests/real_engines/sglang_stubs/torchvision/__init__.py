"""Import-only stand-in for ``torchvision`` (engine side only).

Why: SGLang 0.5.23 imports ``torchvision.transforms`` (and ``.functional``, ``.v2.functional``,
``InterpolationMode``) at module level in multimodal processors that the server imports on
start, even for a text-only model; and the registry's ``torchvision`` wheels are CUDA-linked
(``operator torchvision::nms does not exist`` against the CPU torch 2.13.0, which then breaks
transformers' model-config imports). Image processing is never used by the real-engine suite.

Every ``torchvision.*`` submodule imports; every attribute is a placeholder class that can be
referenced, subclassed and have attributes read (``InterpolationMode.BICUBIC`` as a default
argument), but instantiating or calling one raises ``RuntimeError``. There is no package
metadata, and ``sitecustomize`` makes ``importlib.util.find_spec("torchvision")`` answer None,
so transformers' availability checks see no torchvision and never use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+pd-router-stub"


class _AbsentMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"torchvision stand-in: {cls.__qualname__} is not available")


def _placeholder(qualname: str) -> type:
    cls = _AbsentMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})
    return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # every submodule is a package too: torchvision.transforms.v2...


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


sys.meta_path.append(_StubFinder())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"{__name__}.{name}")
