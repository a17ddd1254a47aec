"""What users run: the offline ``LLM`` and ``pagedserve generate`` (the HTTP server is server/api/)."""
