"""Subcommands of `python -m harness` (see harness.subcommands for the contract)."""
