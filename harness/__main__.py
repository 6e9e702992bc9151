import sys

from harness.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
