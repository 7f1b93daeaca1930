"""Test-only helpers that no user command needs (what the benchmarks need too is in pipegen/bench/doubles/)."""
