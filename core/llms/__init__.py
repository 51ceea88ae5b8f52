"""The served models: their specs, demo models and GGUF files, and how a validated request
becomes a model's input and its output a result line (``generation``)."""
