"""Stage 4: what computes a norm: the float64 oracle, the built-in candidates and user plugins."""
