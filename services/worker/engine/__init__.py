"""kvmesh's inference engine: paged KV cache, continuous batching, prefix caching, KV transfer.

The package exports nothing itself, so that its torch-free modules (`config`, `request`) load
without torch. Entry points: `llm.LLM` (offline batches), `async_engine.AsyncEngine` (what a
worker serves), `engine.Engine` (one step at a time), `request` (the value types).
"""
