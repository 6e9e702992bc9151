"""What every stage shares and nothing else: the errors users see, output helpers (tables, CSV, safe writes),
the progress display and the subcommand registry. Pure Python: no torch, MPI or h5py."""
