"""The torch side: the model runner, the paged KV cache and attention, packed CPU weights, sampling.

Runs real transformers causal LMs on CPU and CUDA. Nothing here decides *what* runs in a step; the
core's scheduler does, and the runner only executes it. ``labkit.runtime.hf`` (``generate_batch``)
imports no torch until it runs.
"""
