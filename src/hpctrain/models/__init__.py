"""Networks (plain nn.Modules) and the LightningModule that trains any of them as a classifier."""
