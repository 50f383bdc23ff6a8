"""The async-context-manager plumbing shared by every resource-owning class of ``transfer/``."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncClosing"]


class AsyncClosing:
    """``async with obj:`` enters as ``obj`` (override ``__aenter__`` to open something) and
    exits through ``aclose()``, which subclasses implement and keep idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        raise NotImplementedError
