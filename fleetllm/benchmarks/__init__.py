"""Benchmarks the `fleetllm bench` command runs: throughput (against transformers' generate and
continuous batching, with the roofline), latency (against HF generate, with the memory-bandwidth
bound) and rpc (executor round trips). Each has add_arguments(parser), run(args) and
main(argv)."""
