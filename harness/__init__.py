"""distsim-harness: spec, models, events, profilers and the HDF5 store (`python -m harness`).

Importing `harness` loads no torch or MPI: the spec, layers, schedules and events modules are pure
Python so that the analysis can use them offline.
"""
__version__ = "0.1.0"
