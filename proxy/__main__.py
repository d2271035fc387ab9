"""``python -m proxy`` and the ``upshift`` console script."""

from __future__ import annotations

from proxy.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
