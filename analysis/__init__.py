"""distsim analysis: rebuild every device's timeline of one training iteration from profile.h5, offline.

One module per analysis, a thin front end (`python -m analysis COMMAND`):
  profile        load profile.h5 into a typed Profile
  costs          the duration of every event of a plan (measured, or fitted with an alpha-beta model)
  simulate       the timeline model: layer -> stage -> pipeline schedule -> data-parallel sync
  predict        profile + spec + strategy -> plan, costs and timeline in one call
  devices        which devices to report, trace or draw
  report         the summary as a table or JSON
  trace          Chrome/Perfetto trace
  plot           Gantt chart (PNG)
  timeline_store timeline HDF5

Nothing here needs MPI, torch or a GPU: it imports only the pure-Python parts of `harness`
(spec, layers, schedules, events, errors, tables, cli), numpy and h5py (matplotlib for --png).
"""
__version__ = "0.1.0"
