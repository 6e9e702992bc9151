"""distsim analysis: rebuild every device's timeline of one training iteration from profile.h5, offline.

One module per analysis, a thin front end (`python -m analysis COMMAND`):
  profile_reader  load profile.h5 into a typed Profile
  costs           the duration of every event of a plan (measured, or fitted with an alpha-beta model)
  skew            how far the slowest data-parallel replica lags, from the profile's ranks' speeds
  simulate        the timeline model: layer -> stage -> pipeline schedule -> data-parallel sync
  intervals       the interval algebra (union, intersection, windows, lanes) the others build on
  predict         profile + spec + strategy -> plan, costs and timeline in one call
  devices         which devices to report, trace or draw
  report          the summary as a table or JSON
  perfetto        Chrome/Perfetto trace
  plot            Gantt charts (PNG)
  timeline_file   timeline HDF5
  trace_reader    trace.h5 of a real run
  validate        a real run against the prediction; compare: both side by side

Nothing here needs MPI, torch or a GPU: it imports only the pure-Python parts of `harness`
(spec, layers, schedules, events, errors, output, cli, hdf5_io, hdf5_schema, profile_store), numpy
and h5py (matplotlib for --png).
"""
__version__ = "0.1.0"
