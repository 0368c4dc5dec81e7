"""Datamodules: MNIST, Fashion-MNIST, scikit-learn digits and random tensors, all held in memory."""
