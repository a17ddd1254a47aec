"""Prefill/decode disaggregation's worker side and channel: moving a request's KV blocks from the engine
that computed its prompt to the engine that decodes it (vLLM's KV connector, ``--kv-transfer-config``).

``mooncake_agent.py`` moves the bytes (Mooncake's transfer engine); ``side_channel.py`` lets a decode
engine acquire a prefill engine's held blocks before reading them and release them after. The settings
(server/kv_transfer_config.py) and the ``kv_transfer_params`` the API carries between the two engines
(server/kv_transfer_params.py) sit in the engine's shared layer; the scheduler side (which blocks to hold,
which to read) is server/core/mooncake_connector.py, the worker that drives the agent on each rank
server/worker/kv_connector_workers.py.
"""
