"""The data sets timm's dataset factory imports by name; none can be made (nothing is
downloaded in the tests)."""

from .._missing import module_getattr, unavailable_class

NAMES = ("CIFAR10", "CIFAR100", "MNIST", "KMNIST", "FashionMNIST", "ImageFolder")
__all__ = list(NAMES)
__getattr__ = module_getattr(__name__)

CIFAR10, CIFAR100, MNIST, KMNIST, FashionMNIST, ImageFolder = (
    unavailable_class(__name__, n) for n in NAMES)
