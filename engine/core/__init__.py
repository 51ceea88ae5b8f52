"""The continuous-batching step: config, sequences, KV blocks, scheduler, model runner, sampler."""
