"""What the engine server, the router and the operator share, with no torch: block hashing
(block_hash.py), chat-template rendering (chat_template.py), OpenAI error bodies (errors.py), client
disconnects (disconnect.py) and the ModelDeployment resource's names (resource.py)."""
