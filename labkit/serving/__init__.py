"""Serving measured: TTFT/TPOT/ITL metrics, seeded workloads, the online driver, baselines and ``labkit bench``."""
