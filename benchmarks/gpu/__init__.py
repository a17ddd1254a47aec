"""GPU benchmarks and the random-weight models the GPU tests share (``pagedserve.benchmarks.gpu``).

Run as ``python -m pagedserve.benchmarks.gpu.<name>`` after ``pip install --no-deps -e .``, or all of them
with benchmarks/gpu/run_all.sh; see benchmarks/gpu/README.md.
"""
