"""Prefill/decode disaggregation: moving a request's KV blocks from the engine that computed its prompt to
the engine that decodes it (vLLM's KV connector, ``--kv-transfer-config``).

``config.py`` parses vLLM's JSON; ``params.py`` is the ``kv_transfer_params`` the API carries between
the two engines; ``mooncake_agent.py`` is the worker side (the bytes, over Mooncake's transfer engine);
``side_channel.py`` lets a decode engine tell the prefill engine it may free the blocks it read. The
scheduler side (which blocks to hold, which to read) is server/core/kv_connector.py.
"""
