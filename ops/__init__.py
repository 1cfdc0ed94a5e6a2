"""Running kinfer: the local stack, the command line, the demo, benchmarks."""
