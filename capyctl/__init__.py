"""CapyCTL's control plane: the Django project, its apps and the ``capyctl`` CLI."""

__version__ = "0.1.0"
