"""Inference servers that solar-host runs as their own processes (hf_server)."""
