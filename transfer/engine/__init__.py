"""Transfer engines behind one seam (see base.py)."""

from __future__ import annotations
