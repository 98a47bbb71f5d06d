"""The packages a wheel holds: ``capyctl`` and ``hostagent`` as found, and the pages'
templates and assets, which stay at the top of the tree (``templates/``, ``static/``) and
travel inside the package as ``capyctl/_web/`` (``capyctl/settings.py`` finds them either
way). Everything else is declared in ``pyproject.toml``."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["capyctl", "capyctl.*", "hostagent", "hostagent.*"]),
        "capyctl._web.templates",
        "capyctl._web.static",
    ]
)
