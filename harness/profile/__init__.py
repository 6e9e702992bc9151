"""The profiling run: the plan's unique events spread over the ranks (run.py) and measured by the profilers
(compute, point-to-point and collectives, memory, the speed probe, timers); hands on samples to the store."""
