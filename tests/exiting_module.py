"""A user's module written as a script: importing it ends the process (what check_factory must report)."""
import sys

sys.exit(0)


def build(model):
    return []
