"""coldsnap-provider: the ColdSnap host provider daemon."""

__version__ = "0.1.0"

__all__ = ("__version__",)
