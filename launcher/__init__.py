"""Topology discovery and placement of events and communication groups over the ranks at hand."""
