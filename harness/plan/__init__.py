"""The job described, before anything runs: spec -> layers -> events (unique, with their placement needs),
schedules, search candidates, the network and routing descriptions, sampling precision. Hands on a JobSpec and
an EventPlan. Pure Python and numpy: no torch, MPI or h5py, so the launcher and the analysis can use it."""
