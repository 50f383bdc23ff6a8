"""A simulated engine worker (``pd-worker``) and a one-command local cluster (``pd-cluster``)."""

from __future__ import annotations
