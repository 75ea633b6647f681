"""Looking at nets and runs, for the command, the tools and the benchmarks: per-layer
timings and the nets they time, peak memory (timing.py), and training logs as tables and
curves (logparse.py)."""
