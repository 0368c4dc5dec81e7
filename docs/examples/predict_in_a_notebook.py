import hpctrain


def class_probabilities(checkpoint: str, images):
    """images: uint8 (B, C, H, W), as the datamodule's batches hold them."""
    model = hpctrain.load(checkpoint)  # e.g. "logs/train/runs/<run>/checkpoints/last.ckpt"
    return model(images).softmax(dim=1)  # model.config: the model and data config it was trained with
