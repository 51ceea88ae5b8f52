"""What the tests feed the service: request lines (:mod:`testkit.builders.lines`), batches and
rows for the worker tests (:mod:`testkit.builders.worker`), LoRA adapters
(:mod:`testkit.builders.lora`)."""
