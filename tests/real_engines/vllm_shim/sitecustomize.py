"""Let vLLM 0.32's MooncakeConnector start on a machine without an accelerator.

Put this directory on a vLLM engine's ``PYTHONPATH`` (only the engine's: the router and the tests
never import torch). Python imports ``sitecustomize`` at start-up in every process of the engine,
the EngineCore child included.

Why: ``MooncakeConnectorWorker.__init__`` (``vllm/distributed/kv_transfer/kv_connector/v1/
mooncake/mooncake_connector.py``) calls ``torch.accelerator.current_device_index()``
unconditionally, which raises ``RuntimeError: Cannot access accelerator device when none is
available`` on a CPU-only machine. The value (``device_id``) is used nowhere else, so 0 is safe.
The upstream one-line fix is::

    self.device_id = (
        torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    )

This shim makes ``current_device_index()`` return 0 when ``torch.accelerator.is_available()`` is
False, which is the same thing seen from the connector; with an accelerator it changes nothing.
"""

from __future__ import annotations


def _patch_current_device_index() -> None:
    try:
        import torch
    except ImportError:  # some other Python run with this PYTHONPATH: nothing to patch
        return
    accelerator = torch.accelerator
    original = accelerator.current_device_index

    def current_device_index() -> int:
        return int(original()) if accelerator.is_available() else 0

    accelerator.current_device_index = current_device_index


_patch_current_device_index()
