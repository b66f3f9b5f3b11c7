"""Load generators and benchmarks; results go to docs/benchmarks.md."""
