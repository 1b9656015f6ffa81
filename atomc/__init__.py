"""atomc: compile PyTorch models into swappable sub-models (ATOM) and lay them out over networks
(DT-FM)."""

__version__ = "0.1.0"
