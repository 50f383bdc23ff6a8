"""``python -m bench.soak``: the fault-matrix soak (``bench.soak.main``)."""

from __future__ import annotations

from bench.soak.main import main

if __name__ == "__main__":
    main()
