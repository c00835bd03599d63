"""Benchmarks the `fleetllm bench` command runs: throughput (against HF generate) and rpc
(executor round trips). Each has add_arguments(parser), run(args) and main(argv)."""
