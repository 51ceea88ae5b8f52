"""Who runs next: the engine host, its fair queue, tenant shares and the urgent-work policy."""
