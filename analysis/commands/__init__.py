"""Subcommands of `python -m analysis` (see analysis.cli for the contract)."""
