"""The served models: their specs, demo models and GGUF files."""
