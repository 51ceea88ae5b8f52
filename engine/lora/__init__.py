"""LoRA adapters served per request: peft's adapter directories read and checked against the
base model (:mod:`.adapter`), the resident set (:mod:`.manager`) and the deltas each step adds to
the base's linear layers, row by row (:mod:`.layers`). How: docs/engine.md ("LoRA adapters")."""

from engine.lora.adapter import AdapterError

__all__ = ["AdapterError"]
