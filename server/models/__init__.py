"""Model implementations: ``build_model(hf_config, dtype, device)`` picks one by architecture."""
