"""The cluster-wide prefix index (compiled, with its Python reference), eviction tracking, prefix
instability and cache tiers: which worker holds which KV block, and what that costs."""
