"""The managed models directory: pulls from HuggingFace and OCI registries, listing, deletion."""
