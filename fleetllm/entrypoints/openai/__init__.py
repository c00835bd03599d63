"""The OpenAI-compatible HTTP server (`fleetllm serve`). Importing this package is cheap: the
web stack loads only with api_server / launcher."""
