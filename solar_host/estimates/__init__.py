"""Memory estimates of instance configs, computed from the model's own files before any start.

`estimate_config` (dispatch.py) is the entry point; `capacity.py` turns estimates into the fit
check and GPU placement of a start. Everything here is pure except the file header reads.
"""
