"""solar-host: the host agent of the solar fleet."""

__version__ = "0.3.0"
