"""The HDF5 store: layout and schema versions, profiles and collectives files written and read, the output
folder's lock. Hands on a Profile (measurements per event) to the analysis. h5py and numpy; no torch or MPI."""
