"""Stage 6: from a failing layer's strata to its cause."""
