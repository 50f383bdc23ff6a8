"""Pure-torch stand-in for SGLang's kernel package ``sgl_kernel`` (engine side only).

Why: SGLang's CPU kernels ship in ``sgl-kernel``/``sglang-kernel``, and the registry has only
CUDA wheels of both (no sdist, no CPU build). On a CPU without AMX SGLang's layers already run
torch-native code (``--attention-backend torch_native``); only these two kernels are imported
unconditionally when ``is_cpu()``:

* ``sglang/srt/mem_cache/allocation.py`` calls :func:`assign_req_to_token_pool_cpu` for every
  prefill/extend batch (writes each request's new KV slot indices into the req-to-token pool);
* ``sglang/kernels/ops/kvcache/cache_move.py`` imports :func:`copy_all_layer_kv_cache_cpu`
  (KV slot moves between layers' buffers; not reached by the real-engine suite).

Both reproduce the semantics of SGLang's Triton kernels of the same name (``allocation.py``
``assign_req_to_token_pool``, ``cache_move.py`` ``copy_all_layer_kv_cache_tiled``).

The speculative-decoding kernels (``sglang/kernels/ops/speculative/*.py``) are imported by name on
CPU too, but only run with ``--speculative-algorithm``, which the suite never uses: they exist here
and raise ``NotImplementedError``. Names are listed explicitly (no module ``__getattr__``) so that
SGLang's own ``hasattr``/``ImportError`` probes of other kernels still see them absent.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+pd-router-stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + n_i]``
    where ``n_i = end[i] - start[i]`` and ``o_i`` is the sum of the previous requests' ``n``."""
    del pool_len  # the row length of req_to_token; torch indexing knows it
    out = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = int(end) - int(start)
        if count > 0:
            req_to_token[int(row), int(start) : int(end)] = out_cache_loc[out : out + count].to(
                req_to_token.dtype
            )
        out += count


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer ``b`` (its base address ``data_ptrs[b]``, ``strides[b]`` bytes per slot):
    copy slot ``src_loc[j]`` to slot ``tgt_loc[j]``. All rows are read before any is written, as
    in the Triton kernel, so overlapping in-place moves are safe."""
    sources = src_loc.tolist()
    targets = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows: list[Any] = [
            ctypes.string_at(int(base) + int(s) * int(stride), int(stride)) for s in sources
        ]
        for target, row in zip(targets, rows, strict=True):
            ctypes.memmove(int(base) + int(target) * int(stride), row, int(stride))


def _speculative_only(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel stand-in: {name} (speculative decoding only)")

    kernel.__name__ = name
    return kernel


build_tree_kernel_efficient_cpu = _speculative_only("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _speculative_only("verify_tree_greedy_cpu")
rotate_input_ids_cpu = _speculative_only("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _speculative_only("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _speculative_only("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _speculative_only("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _speculative_only("assign_extend_cache_locs_cpu")
