"""Small models for recipes, tests and benchmarks, and the ``ClassifierModule`` that trains them."""

from lightning_pdist.models.classifier import ClassifierModule, build_model
from lightning_pdist.models.cnn import SmallCNN
from lightning_pdist.models.mlp import MLP
from lightning_pdist.models.encoder import EncoderClassifier
from lightning_pdist.models.text import BagOfEmbeddings
from lightning_pdist.models.sparse_text import SparseBagClassifier

__all__ = ["MLP", "BagOfEmbeddings", "ClassifierModule", "EncoderClassifier", "SmallCNN", "SparseBagClassifier", "build_model"]
