"""Models: the image classifier (any network), the character language model, their networks and metrics."""
