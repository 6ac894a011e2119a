"""Stage 2: a checkpoint read as a model: its family (configs/families), its norm layers with
their full semantics, and the pairing of an original with a converted copy."""
