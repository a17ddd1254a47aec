"""Helpers for pagedserve's own tests and benchmarks: free ports, real server and router processes,
a fake OpenAI backend, and the Kubernetes manifest validator.

Not part of the product: pyproject.toml leaves it out of the wheel (so out of the images). A clone's
editable install (``make setup``) imports it from this folder, so ``tests/``, ``e2e/`` and the benchmarks
run by hand use it as a package, with no ``sys.path`` edits. Importing it never imports torch: the
router's tests run without it.

- net.py: ``free_port()``, ``wait_http()`` (fails at once, with the log's tail, when the server dies)
- processes.py: ``serve_process()``, ``router_process()``, ``fake_openai_process()`` and
  ``ManagedProcess`` for any command: a log file, SIGTERM then SIGKILL to the whole group, always;
  ``float_model_args()`` (the embedded model's float32 weights) and ``DEMO_QUESTION``/``DEMO_ANSWER``
- fake_openai.py: ``FakeOpenAI``, the one fake engine replica (router tests, bench tests, benchmarks)
- server_thread.py: ``ServerThread``, an ASGI app on uvicorn inside the test process
- tiny_tokenizer.py: a byte-level tokenizer folder with a chat template (no hub, no torch)
- kubeconfig.py: ``kubeconfig_env()``, a child's environment pointed at a local Kubernetes API (kmock)
- kmock_cluster.py: ``emulated_cluster()``, kmock's emulator serving what the operator uses, and
  ``running_operator()``, the real operator against it
- openapi_fuzz.py: ``fuzz_openapi()``, schemathesis over a live server's /openapi.json
- pod_security.py: ``restricted_violations()``, the Pod Security Standards "restricted" profile
- sandbox.py: ``read_only_root()``, a process with a pod's read-only root filesystem (mount namespaces)
- kernels.py: paged KV-cache, LoRA, MoE and GGUF cases for the kernel tests and kernel benchmarks
- api_fakes.py: ``FakeEngine`` and ``app_client()``, the API server over a scripted engine
- bench_helpers.py: ``standin()`` and ``bench_args()`` for the ``pagedserve bench`` tests
- operator_examples.py: the design's example ModelDeployment and a LoRA spec
"""
