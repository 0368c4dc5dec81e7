"""Datamodules: scikit-learn's digits (quickstart), MNIST, Fashion-MNIST, CIFAR-10, random tensors and text."""
