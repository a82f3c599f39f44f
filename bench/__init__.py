"""The benchmarks: each module with a `main` runs from the repository root as `python -m bench.<name>`
and writes its JSON to bench/results/; bench.common holds what they share."""
