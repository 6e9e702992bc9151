"""Profilers: compute events on one rank, P2P pairs and collective groups; every sample kept."""
