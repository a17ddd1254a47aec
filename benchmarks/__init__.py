"""Benchmarks, as the package ``pagedserve.benchmarks`` (pyproject.toml maps this folder to it).

`pagedserve bench` runs serve.py, throughput.py and plot.py (datasets.py holds their prompt sets); the
scripts run by hand are modules: ``python -m pagedserve.benchmarks.<name>`` for cpu_kernels,
http_overhead and router_overhead, ``pagedserve.benchmarks.gpu.<name>`` on a GPU machine. Commands and
figures: benchmarks/README.md. Nothing here is imported eagerly: `pagedserve bench serve` needs no torch.
"""
