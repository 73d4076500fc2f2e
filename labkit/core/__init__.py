"""The engine's core: block allocator, scheduler, requests, step reports and traces, the engine loop, the simulator.

Plain Python with no torch import, so every decision the engine makes can be read, taught and tested on
its own, driven by the simulated model. The model side plugs in as a *runner* (see ``labkit.core.engine``).
"""
