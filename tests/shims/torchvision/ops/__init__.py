from .._missing import module_getattr
from . import misc

__all__ = ["misc"]
__getattr__ = module_getattr(__name__)
