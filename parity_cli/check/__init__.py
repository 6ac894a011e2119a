"""Stage 5: one layer through both sides, compared stratum by stratum; the results as values."""
