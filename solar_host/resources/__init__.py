"""Capacity of the machine and the reservation ledger (probes, ledger, usage, service)."""
