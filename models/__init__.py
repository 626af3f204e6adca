"""Reference CTR models (LR, FM, DNN, Wide&Deep, DeepFM) as plain tf.keras functional models."""
from models.zoo import MODELS, build, deepfm, dnn, fm, lr, wdl
from models.optim import make_optimizer

__all__ = ["MODELS", "build", "lr", "fm", "dnn", "wdl", "deepfm", "make_optimizer"]
