"""`python -m analysis` (console script `distsim-analysis`)."""
import sys

from analysis.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
