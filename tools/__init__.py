"""Development tools that are neither the package nor its benchmarks, each run from the repository
root as `python -m tools.<name>`."""
