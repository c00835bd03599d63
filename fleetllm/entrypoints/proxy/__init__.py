"""`fleetllm proxy`: disaggregated prefill and decode behind one OpenAI API (app.py)."""
