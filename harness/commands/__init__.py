"""Subcommands of `python -m harness` (see harness.common.subcommands for the contract)."""
