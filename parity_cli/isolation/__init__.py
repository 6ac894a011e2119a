"""Stage 4b: where a candidate runs: in this process (trusted built-ins) or in a supervised
child that cannot reach what the verdict rests on."""
