"""Containerised multi-step jobs (JobService in service.py)."""
