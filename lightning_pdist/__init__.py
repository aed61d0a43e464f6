"""lightning_pdist: distributed-training algorithms from the literature as Lightning strategies."""
