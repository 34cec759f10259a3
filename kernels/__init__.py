"""Floor 1: paged attention and KV-cache writes (torch reference and Triton), chosen by a registry."""
