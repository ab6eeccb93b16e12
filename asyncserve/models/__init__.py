"""Model definitions, weight loading and the architecture registry."""
