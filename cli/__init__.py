"""runplane's application layer: the `runplane` command and its demo.

The only layer that may import engine, actors and simulations together; nothing imports it.
"""

from .main import main

__all__ = ["main"]
