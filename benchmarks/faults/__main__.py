"""`python -m benchmarks.faults` (from the repository root): see __init__.py."""

import sys

from benchmarks.faults.cli import main

if __name__ == "__main__":
  sys.exit(main())
