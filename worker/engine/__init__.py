"""A request's life in one group: admitted, scheduled step by step over the paged KV cache's
blocks, detokenized, and its outputs handed back (the engine and its asyncio front)."""
