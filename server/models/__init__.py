"""Model implementations: ``build_model(hf_config, dtype, device, backend)`` picks one by architecture."""
