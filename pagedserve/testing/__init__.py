"""Helpers for pagedserve's own tests and benchmarks: free ports, real server and router processes,
a fake OpenAI backend, and the Kubernetes manifest validator.

Importable from an installed pagedserve (``tests/``, ``e2e/`` and ``benchmarks/`` use it as a package,
with no ``sys.path`` edits). Importing it never imports torch: the router's tests run without it.
"""
