"""Stage 7: results as a person and a CI read them: the JSON report's renderings, the gate,
and saved reports read back as data."""
