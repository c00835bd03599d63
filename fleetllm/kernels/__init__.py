"""fleetllm's C++ CPU kernels (sources in csrc/): `build.py` compiles and loads them for this
CPU, `cpu_kernels.py` is the Python binding every caller uses (attention, projections, the
fused decoder layer, sampling)."""
