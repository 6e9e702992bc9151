"""Subcommands of `python -m harness` (see harness.cli for the contract)."""
